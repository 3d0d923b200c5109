"""Conditional disaggregation: prefill a prompt on the prefill pool, or on the decode node
that will decode it.

Disaggregation keeps long prefills out of decode steps, but it is not free for every prompt:
a short prompt waits behind the prefill pool's queue (a 1,000-token prompt computing there
holds it for seconds) and its KV then crosses the network, where the decode node could have
computed it in one step. As vLLM's early conditional disaggregation and Dynamo's local-prefill
threshold do, `auto` sends a prompt straight to a decode node when that is estimated to give
an earlier first token, by more than the wait its prefill adds to the decode node's running
streams, and the prompt is short enough not to stall them for long:

    local  iff  a decode node has a free slot and blocks for the prompt,
                its uncached tokens <= local_max_tokens (the stall bound), and
                its estimated TTFT + stall < the prefill pool's best estimate,
    stall     = uncached / rate x the streams it decodes (running, reserved, sent since)

with both estimates from the router (router.py): (queued prompt tokens + this prompt's
uncached tokens there) / the node's measured prefill rate (a decode node that has not
prefilled yet borrows the prefill pool's rate). `stall` is the waiting a local prefill adds
in all: each of the node's streams waits for its tokens, so the first token it brings
forward must save more than that. A short or mostly cached prompt (the decode node caches
every prompt it decoded, and a chat's earlier answers), a long prefill queue and a lightly
loaded decode node favour local; an idle prefill pool wins ties. Without the stall term
(before session 30), a decode node that was the bottleneck (bfloat16 on this CPU, past 3
req/s) kept taking short prompts while the prefill pool had any queue: its steps with a
prompt chunk took 129 ms against 86, 19% of its time, and `auto`'s goodput fell below
`always`'s. With no healthy prefill node, `auto` prefills locally rather than fail.

    always  every prompt on the prefill pool (static disaggregation)
    never   every prompt on a decode node (the decode pool serves colocated)

Each decision carries both estimates and a reason; the backend writes it to the request's
trace and counts it (`pdserve_proxy_placements_total{mode, placement, reason}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from prometheus_client import CollectorRegistry, Counter

from proxy.pool.router import Decision, Estimate


class DisaggMode(str, Enum):
    ALWAYS = "always"
    NEVER = "never"
    AUTO = "auto"


DISAGG_MODES = tuple(m.value for m in DisaggMode)
REASONS = ("mode", "earlier", "not_earlier", "too_long", "no_room", "no_prefill_node")


@dataclass(frozen=True)
class PlacementConfig:
    mode: DisaggMode = DisaggMode.AUTO
    # auto: the most uncached prompt tokens a decode node prefills itself. It bounds the
    # stall a local prefill adds to the decode node's running streams (one engine step of
    # that many more tokens: on one CPU core about a second at 256).
    local_max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.local_max_tokens < 0:
            raise ValueError(f"local_max_tokens must be >= 0, got {self.local_max_tokens}")


@dataclass(frozen=True)
class Placement:
    local: bool
    reason: str  # one of REASONS
    mode: DisaggMode
    remote: Decision | None  # the prefill pool's pick (None: no healthy prefill node)
    local_best: Estimate | None  # the decode node with room, the lowest estimate + stall
    stall_s: float = 0.0  # auto: the wait a local prefill adds to local_best's streams, summed

    def __post_init__(self) -> None:
        assert self.reason in REASONS, self.reason
        assert not self.local or self.local_best is not None, "local needs a decode node"
        assert self.local or self.remote is not None, "remote needs a prefill node"

    def detail(self) -> str:
        """The trace row's detail: the choice, its reason and both estimates."""
        where = "local" if self.local else "prefill pool"
        parts = [f"{self.mode.value}: {where} ({self.reason})"]
        if self.local_best is not None:
            stall = f" + {self.stall_s * 1000:.0f} ms stall" if self.stall_s else ""
            parts.append(f"decode {self.local_best.describe()}{stall}")
        if self.remote is not None:
            parts.append(f"prefill {self.remote.chosen.describe()}")
        return "; ".join(parts)


def place(config: PlacementConfig, remote: Decision | None, local: list[Estimate]) -> Placement:
    """Where to prefill, given the prefill pool's pick (`remote`, None if the pool has no
    healthy node) and the estimates of the decode nodes with room for the prompt (`local`).
    Raises ValueError when neither is possible."""
    best = min(local, key=lambda e: e.ttft_s + stall_s(e)) if local else None
    if remote is None and best is None:
        raise ValueError("no prefill node and no decode node with room")
    mode = config.mode

    def decide(is_local: bool, reason: str, stall_s: float = 0.0) -> Placement:
        return Placement(is_local, reason, mode, remote, best, stall_s)

    if mode is DisaggMode.ALWAYS or best is None:
        return decide(False, "mode" if mode is DisaggMode.ALWAYS else "no_room")
    if mode is DisaggMode.NEVER or remote is None:
        return decide(True, "mode" if mode is DisaggMode.NEVER else "no_prefill_node")
    if best.uncached > config.local_max_tokens:
        return decide(False, "too_long")
    stall = stall_s(best)
    if best.ttft_s + stall < remote.chosen.ttft_s:
        return decide(True, "earlier", stall)
    return decide(False, "not_earlier", stall)


def stall_s(e: Estimate) -> float:
    """The wait that prefilling `e`'s prompt on its decode node adds to the node's streams,
    summed over them: its uncached tokens' compute time, once per stream."""
    return e.uncached / e.rate * e.node.decode_streams()


class PlacementMetrics:
    def __init__(self, registry: CollectorRegistry, mode: DisaggMode) -> None:
        self.mode = mode
        self.decisions = Counter(
            "pdserve_proxy_placements",
            "Where prompts were prefilled (conditional disaggregation): on the prefill pool "
            "(remote) or on the decode node that decodes them (local), by the proxy's "
            "--disagg-mode and the decision's reason",
            ["mode", "placement", "reason"],
            registry=registry,
        )

    def count(self, placement: Placement) -> None:
        where = "local" if placement.local else "remote"
        self.decisions.labels(placement.mode.value, where, placement.reason).inc()
