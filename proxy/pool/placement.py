"""Conditional disaggregation: prefill a prompt on the prefill pool, or on the decode node
that will decode it.

Disaggregation keeps long prefills out of decode steps, but it is not free for every prompt:
a short prompt waits behind the prefill pool's queue (a 1,000-token prompt computing there
holds it for seconds) and its KV then crosses the network, where the decode node could have
computed it in one step. As vLLM's early conditional disaggregation and Dynamo's local-prefill
threshold do, `auto` sends a prompt straight to a decode node when that gives an earlier
first token by more than the local prefill costs the decode node's other streams, and the
prompt is short enough not to stall them for long:

    local  iff  a decode node has a free slot and blocks for the prompt,
                its uncached tokens <= local_max_tokens (the stall bound), and
                gain > cost, where
                gain = the prefill pool's best TTFT estimate - the decode node's
                cost = the streams that node decodes x this prompt's prefill time there

or, when the proxy is given the TTFT objective (`--slo-ttft-ms`), the first token would miss
it from the prefill pool and meet it from the decode node (reason `meets_ttft_slo`), both
counted from the request's arrival: the time it has waited so far, for the pool also the
prompts ahead of it at the edge (at the pool's summed rate; the edge holds prompts back
while the pool's queue is over its backlog horizon, so the pool's own estimate alone never
sees that wait), plus the estimate. The prompt would be late anyway, and the stall is what
saves it. The objective only adds local placements that the cost alone refuses (where the
prefill pool, not the decode node, is the bottleneck); without it `auto` decides on latency
alone.

With the TPOT objective too (`--slo-tpot-ms`), the least slack of the decode node's streams
(what the slowest of them may still lose before its TPOT misses the objective,
decode_clocks.py) bounds the stall instead of the cost: a prompt either rule would prefill
locally stays on the prefill pool (reason `misses_tpot_slo`) when its prefill time on the
node exceeds that slack, and one whose first token comes earlier locally but which the cost
refuses is prefilled there when the slack holds its stall (reason `fits_tpot_slo`). The cost
weighs latency in all; the slack keeps every stream within its objective, which is what a
goodput counts. (Session 39's G30, the cost deciding: 68 of 309 prompts went to the prefill
pool as `stalls_decode`, to wait there behind 800-token prompts, where a decode step of
64-80 ms gives a fresh 64-token stream about 1.4 s of slack under a 100 ms objective.) While no
stream there is timed yet, the cost decides as without the objective.

The estimates come from the router (router.py): (queued prompt tokens + this prompt's
uncached tokens there) / the node's measured prefill rate (a decode node that has not
prefilled yet borrows the prefill pool's rate). Each of the node's streams waits one step
longer by the prompt's prefill time, so `cost` is what they lose in all and `gain` what the
prompt wins: the choice that costs less latency in total. A short or mostly cached prompt
(the decode node caches every prompt it decoded, and a chat's earlier answers) and a long
prefill queue favour local, a busy decode node the prefill pool; an idle prefill pool wins
ties. Where the decode pool has several nodes with room, the one with the smallest estimate
plus cost is the candidate. With no healthy prefill node, `auto` prefills locally rather than
fail.

Without the cost (session 35, in bfloat16, TTFT <= 5 s and TPOT <= 100 ms), `auto` prefilled
nearly every short prompt locally whenever one long prompt was computing on the prefill
node: a 48-token prefill adds 65-110 ms to a decode step on one core, the decode node's
TPOT p50 rose from 48 to 74 ms, and its goodput fell to half of static disaggregation's,
every miss a TPOT miss, while the prefill node it relieved had headroom. With the cost
and no objective, where the prefill node is the bottleneck (float32, TTFT binding) it lost
about a search step against the rule without the cost (1.3 against 1.4 req/s): short prompts
waited out the queue and missed their TTFT, where the decode node had time to spare.

    always  every prompt on the prefill pool (static disaggregation)
    never   every prompt on a decode node (the decode pool serves colocated)

Each decision carries both estimates and a reason; the backend writes it to the request's
trace and counts it (`pdserve_proxy_placements_total{mode, placement, reason}`); `always`
decides nothing, and counts each attempt as `remote` with reason `mode`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from prometheus_client import CollectorRegistry, Counter

from proxy.pool.node_state import Node
from proxy.pool.router import Decision, Estimate


class DisaggMode(str, Enum):
    ALWAYS = "always"
    NEVER = "never"
    AUTO = "auto"


DISAGG_MODES = tuple(m.value for m in DisaggMode)
REASONS = (
    "mode",
    "earlier",
    "not_earlier",
    "stalls_decode",
    "meets_ttft_slo",
    "misses_tpot_slo",
    "fits_tpot_slo",
    "too_long",
    "no_room",
    "no_prefill_node",
)


@dataclass(frozen=True)
class PlacementConfig:
    mode: DisaggMode = DisaggMode.AUTO
    # auto: the most uncached prompt tokens a decode node prefills itself. It bounds the
    # stall a local prefill adds to the decode node's running streams (one engine step of
    # that many more tokens: on one CPU core about a second at 256).
    local_max_tokens: int = 256
    # auto: the time-to-first-token objective, in seconds (None: not known). A prompt whose
    # prefill-pool estimate misses it is prefilled on a decode node whose estimate meets it,
    # whatever that costs the node's streams.
    ttft_slo_s: float | None = None
    # auto: the time-per-output-token objective, in seconds (None: not known). A prompt is
    # prefilled on a decode node only if the stall leaves every stream there within it
    # (decode_clocks.py), whatever it gains.
    tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        if self.local_max_tokens < 0:
            raise ValueError(f"local_max_tokens must be >= 0, got {self.local_max_tokens}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")
        if self.tpot_slo_s is not None and not self.tpot_slo_s > 0:
            raise ValueError(f"tpot_slo_s must be > 0, got {self.tpot_slo_s}")


@dataclass(frozen=True)
class Placement:
    local: bool
    reason: str  # one of REASONS
    mode: DisaggMode
    remote: Decision | None  # the prefill pool's pick (None: no healthy prefill node)
    local_best: Estimate | None  # the decode node with room and the lowest estimate + cost
    cost_s: float = 0.0  # auto: what prefilling on local_best costs its streams, in all

    def __post_init__(self) -> None:
        assert self.reason in REASONS, self.reason
        assert not self.local or self.local_best is not None, "local needs a decode node"
        assert self.local or self.remote is not None, "remote needs a prefill node"

    def detail(self) -> str:
        """The trace row's detail: the choice, its reason and both estimates."""
        where = "local" if self.local else "prefill pool"
        parts = [f"{self.mode.value}: {where} ({self.reason})"]
        if self.local_best is not None:
            parts.append(f"decode {self.local_best.describe()}")
            if self.cost_s:
                parts.append(f"cost to its streams {self.cost_s * 1000:.0f} ms")
        if self.remote is not None:
            parts.append(f"prefill {self.remote.chosen.describe()}")
        return "; ".join(parts)


def place(
    config: PlacementConfig,
    remote: Decision | None,
    local: list[Estimate],
    waited_s: float = 0.0,
    pool_wait_s: float = 0.0,
    slack_s: Callable[[Node], float | None] | None = None,
) -> Placement:
    """Where to prefill, given the prefill pool's pick (`remote`, None if the pool has no
    healthy node) and the estimates of the decode nodes with room for the prompt (`local`).
    For the TTFT objective: `waited_s`, how long the request has waited so far, and
    `pool_wait_s`, how long it would still wait at the edge before it may join the prefill
    pool's queue (the prompts ahead of it there). For the TPOT objective: `slack_s`, the
    least slack of a decode node's streams (None: unknown). Raises ValueError when neither is
    possible."""
    best = min(local, key=lambda e: e.ttft_s + stall_cost(e)) if local else None
    if remote is None and best is None:
        raise ValueError("no prefill node and no decode node with room")
    mode = config.mode

    def decide(is_local: bool, reason: str, cost: float = 0.0) -> Placement:
        return Placement(is_local, reason, mode, remote, best, cost)

    if mode is DisaggMode.ALWAYS or best is None:
        return decide(False, "mode" if mode is DisaggMode.ALWAYS else "no_room")
    if mode is DisaggMode.NEVER or remote is None:
        return decide(True, "mode" if mode is DisaggMode.NEVER else "no_prefill_node")
    if best.uncached > config.local_max_tokens:
        return decide(False, "too_long")
    gain, cost = remote.chosen.ttft_s - best.ttft_s, stall_cost(best)
    slo = config.ttft_slo_s
    late = waited_s + pool_wait_s + remote.chosen.ttft_s  # its first token from the pool
    earlier = gain > 0 and gain > cost
    rescues = slo is not None and waited_s + best.ttft_s <= slo < late
    slack = None
    if config.tpot_slo_s is not None and slack_s is not None:
        slack = slack_s(best.node)
    fits = slack is not None and best.uncached / best.rate <= slack
    if slack is not None and not fits and (earlier or rescues):
        return decide(False, "misses_tpot_slo", cost)
    if earlier or rescues:
        return decide(True, "earlier" if earlier else "meets_ttft_slo", cost)
    if gain > 0 and fits:  # the objective, not the summed latency, bounds the stall
        return decide(True, "fits_tpot_slo", cost)
    return decide(False, "not_earlier" if gain <= 0 else "stalls_decode", cost)


def stall_cost(e: Estimate) -> float:
    """Seconds of latency a local prefill of `e`'s prompt adds to decode node `e.node`'s
    streams, in all: each waits one step longer by the prompt's prefill time."""
    return e.node.decode_streams() * e.uncached / e.rate


def has_room(e: Estimate) -> bool:
    """Whether decode node `e.node` has a free slot and blocks for the prompt's uncached
    tokens (its cached ones are there already)."""
    slot, free = e.node.decode_room()
    cap = e.node.state.capacity if e.node.state is not None else None
    block_size = cap.block_size if cap is not None and cap.block_size > 0 else 16
    return slot and free >= -(-(e.uncached + 1) // block_size)


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

    def count_always(self) -> None:
        """An `always` attempt: the prefill pool, undecided (its node is picked later)."""
        self.decisions.labels(DisaggMode.ALWAYS.value, "remote", "mode").inc()
