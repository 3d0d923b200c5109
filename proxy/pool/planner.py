"""The role planner (`--auto-roles`): move one node from the pool with slack to the pool
whose queue wait stays longer, at a bounded rate.

Each sample gives each pool's queue wait, in seconds:
- prefill: what a new prompt waits at the prefill pool, the smallest over its nodes of
  (queued prompt tokens / measured prefill rate), as the router sees them;
- decode: how long the oldest prefilled request has waited in the inter-stage queue for a
  decode node.

`Planner.observe` (pure: fed samples, it returns a decision) asks for a move when one pool's
wait has exceeded the other's by more than `margin_s` in every sample for `window_s`, the
other pool has a node to spare (at least two healthy; one always stays), and the last move
was at least `interval_s` ago. Any sample that does not lean the same way restarts the
window, and so does a move. `AutoRoles` samples the registry every `sample_s` and makes the
moves through the RoleMover, each logged with its reason and counted in /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.pool.node_state import Node, Role
from proxy.pool.registry import NodeRegistry
from proxy.pool.roles import MoveRefused, RoleMover
from proxy.pool.router import DEFAULT_PREFILL_RATE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerConfig:
    window_s: float = 30.0  # the imbalance must last this long
    interval_s: float = 120.0  # at most one move per this
    margin_s: float = 1.0  # a pool's wait must exceed the other's by more than this
    sample_s: float = 1.0  # AutoRoles: seconds between samples

    def __post_init__(self) -> None:
        if min(self.window_s, self.interval_s, self.margin_s) < 0 or self.sample_s <= 0:
            raise ValueError("planner window, interval and margin must be >= 0, sample > 0")


@dataclass(frozen=True)
class PoolSample:
    at: float  # monotonic seconds
    prefill_wait_s: float
    decode_wait_s: float
    prefill_nodes: int  # healthy nodes in each pool
    decode_nodes: int


@dataclass(frozen=True)
class Decision:
    source: Role  # the pool a node leaves
    target: Role  # the pool it joins
    reason: str


class Planner:
    """The decision rule (module doc), as a small state machine over samples."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._leaning: tuple[Role, float] | None = None  # the longer-wait pool, and since
        self._last_move: float | None = None

    def observe(self, s: PoolSample) -> Decision | None:
        target = self._longer(s)
        if target is None:
            self._leaning = None
            return None
        if self._leaning is None or self._leaning[0] is not target:
            self._leaning = (target, s.at)
        since = self._leaning[1]
        source = Role.DECODE if target is Role.PREFILL else Role.PREFILL
        spare = (s.decode_nodes if source is Role.DECODE else s.prefill_nodes) >= 2
        rested = self._last_move is None or s.at - self._last_move >= self.config.interval_s
        if s.at - since < self.config.window_s or not spare or not rested:
            return None
        self._leaning, self._last_move = None, s.at
        return Decision(
            source,
            target,
            f"{target.value} queue wait {_wait(s, target):.2f} s vs {source.value} "
            f"{_wait(s, source):.2f} s, longer by over {self.config.margin_s:g} s for "
            f"{s.at - since:.1f} s",
        )

    def _longer(self, s: PoolSample) -> Role | None:
        if s.prefill_wait_s - s.decode_wait_s > self.config.margin_s:
            return Role.PREFILL
        if s.decode_wait_s - s.prefill_wait_s > self.config.margin_s:
            return Role.DECODE
        return None


def _wait(s: PoolSample, role: Role) -> float:
    return s.prefill_wait_s if role is Role.PREFILL else s.decode_wait_s


def _work(node: Node) -> tuple[int, int]:
    """How much a node is doing, as it last reported (and this proxy sent since)."""
    reqs = node.state.requests if node.state is not None else {}
    return sum(reqs.values()) + node.inflight + node.sent_requests, node.prefill_load()


def prefill_wait_s(registry: NodeRegistry) -> float:
    """A new prompt's wait at the prefill pool: the shortest node backlog in seconds."""
    waits = []
    for node in registry.routable(Role.PREFILL):
        rate = node.state.prefill_tokens_per_s if node.state is not None else None
        waits.append(node.prefill_load() / (rate or DEFAULT_PREFILL_RATE))
    return min(waits, default=0.0)


class AutoRoles:
    """Samples the pools and lets the planner move nodes; `start()`/`stop()` its task."""

    def __init__(
        self,
        registry: NodeRegistry,
        mover: RoleMover,
        decode_wait_s: Callable[[float], float],
        config: PlannerConfig,
    ) -> None:
        self.registry = registry
        self.mover = mover
        self.decode_wait_s = decode_wait_s  # the inter-stage queue's oldest wait at a time
        self.planner = Planner(config)
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> PoolSample:
        now = time.monotonic()
        return PoolSample(
            now,
            prefill_wait_s(self.registry),
            self.decode_wait_s(now),
            len(self.registry.healthy(Role.PREFILL)),
            len(self.registry.healthy(Role.DECODE)),
        )

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="auto-roles")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.planner.config.sample_s)
            decision = self.planner.observe(self.sample())
            if decision is not None:
                await self._move(decision)

    async def _move(self, decision: Decision) -> None:
        """Move the least loaded node of the source pool (the one with the least work)."""
        nodes = [n for n in self.registry.healthy(decision.source) if n.moving_to is None]
        if not nodes:
            return
        node = min(nodes, key=_work)
        try:
            await self.mover.move(node.url, decision.target.value, decision.reason, "planner")
        except MoveRefused as e:
            log.warning("planner: moving %s to %s refused: %s", node.url, decision.target.value,
                        e.message)  # fmt: skip
        except Exception:  # a bug must not stop the planner: the next decision may work
            log.exception("planner: moving %s to %s", node.url, decision.target.value)
