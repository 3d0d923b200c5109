"""A node's role change: the states it goes through and how the old role's work ends.

    SERVING ──POST /internal/role──> DRAINING ──idle──> SWITCHING ──> SERVING (new role, epoch+1)
                                        │ still busy after the hard deadline ──> SERVING (old role)
    any ──SIGTERM──> STOPPING

DRAINING: the old role takes no new work (503 "draining"; the proxy tries another node) and
its work ends under the usual rules: held KV is sent (or released by cancel, lease expiry),
reservations land or time out, decodes finish. After the drain timeout, what is left is
ended by stage (EVICTABLE): held KV is released (the proxy prefills it again elsewhere) and
running decodes are aborted, their streams ending with error_code "role_change" (the proxy
continues them on another decode node, as after a node failure). Transfers in flight and
prefills computing are never cut: they reach an evictable stage or end.

SWITCHING: the old role's tasks end, the engine's block books must balance with nothing
owned (check_integrity), the epoch goes up by one and the new role starts over the same
runtime (engine, KV cache, KV-transfer agent, listener, metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from enum import Enum

from common.node.server import NodeServer
from common.wire.errors import SERVER_ERROR, ApiError
from common.wire.fsm import Transitions
from common.wire.stage import Stage


class RoleState(Enum):
    SERVING = "serving"
    DRAINING = "draining"  # the old role finishes its work; no new work
    SWITCHING = "switching"  # the old role is retired, the new one is being started
    STOPPING = "stopping"  # the node shuts down (terminal)


ROLE_MOVES: Transitions[RoleState] = Transitions(
    "node role",
    {
        RoleState.SERVING: {RoleState.DRAINING, RoleState.STOPPING},
        # back to SERVING: the drain failed (or was called off), the old role serves on
        RoleState.DRAINING: {RoleState.SWITCHING, RoleState.SERVING, RoleState.STOPPING},
        RoleState.SWITCHING: {RoleState.SERVING, RoleState.STOPPING},
        RoleState.STOPPING: set(),
    },
)

SWITCHABLE = frozenset({"prefill", "decode"})
# What a drain that timed out ends, by the old role: the stages whose work can move.
EVICTABLE: dict[str, frozenset[Stage]] = {
    "prefill": frozenset({Stage.HELD}),
    "decode": frozenset({Stage.QUEUED, Stage.RUNNING}),
}
POLL_S = 0.05


class DrainFailed(ApiError):
    """The old role still had work at the hard deadline: the change is called off."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, type=SERVER_ERROR, code="role_change_failed")


async def drain_role(
    role: NodeServer,
    idle: Callable[[], bool],
    stopping: Callable[[], bool],
    timeout_s: float,
    grace_s: float,
) -> int:
    """Drain `role` until `idle()`: `timeout_s` for its work to end by itself, then up to
    `grace_s` more while the evictable stages are ended. Returns how many requests were
    ended; DrainFailed if it is still busy then, or the node started stopping."""
    role.draining = True
    deadline = time.monotonic() + timeout_s
    while not idle() and time.monotonic() < deadline:
        _check_stopping(stopping)
        await asyncio.sleep(POLL_S)
    evicted = 0
    hard = time.monotonic() + grace_s
    while not idle():
        _check_stopping(stopping)
        if time.monotonic() > hard:
            left = len(role.engine.records())
            raise DrainFailed(
                f"the {role.role} role still has {left} requests {timeout_s + grace_s:g} s "
                "into its drain; it serves on"
            )
        evicted += await evict(role)
        await asyncio.sleep(POLL_S)
    return evicted


async def evict(role: NodeServer) -> int:
    """End the role's requests in an evictable stage (once each); how many were ended."""
    stages = EVICTABLE.get(role.role, frozenset())
    ended = 0
    for record in role.engine.records():
        rid = record.request_id
        if record.stage in stages and rid not in role.evicted:
            role.evicted.add(rid)
            await role.cancel(rid)
            ended += 1
    if ended:
        role.metrics.role_evictions.inc(ended)
    return ended


def _check_stopping(stopping: Callable[[], bool]) -> None:
    if stopping():
        raise ApiError(503, "the node is stopping", type=SERVER_ERROR, code="draining")
