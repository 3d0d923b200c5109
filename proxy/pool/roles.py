"""Moving a node between the prefill and the decode pool (POST /admin/nodes/role, the planner).

    move(url, role):  checks ─> registry.begin_move (DRAINING: no new work from this proxy)
                      ─> POST /internal/role {role, epoch, drain_timeout_s} (the node drains,
                         bumps its epoch, serves in the new role) ─> registry.end_move (the
                         node joins its new pool; a former prefill node's queued requests
                         prefill again) ─> counted and logged with its reason

The node is the authority on its role: work this proxy sends carries the epoch it saw, and
a node at another epoch answers 409 stale_epoch (the client reads it as "did not take it").
A move that fails leaves the node in its old role and pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from common.wire.node_messages import RoleChange, RoleChangeResult
from proxy.http.backend import BackendError
from proxy.pool.client import NodeClient
from proxy.pool.node_state import SWITCHABLE_ROLES, Node, Role, normalize_url
from proxy.pool.registry import NodeRegistry

log = logging.getLogger(__name__)

CALL_MARGIN_S = 60.0  # beyond the drain timeout: transfers landing, the switch itself


class MoveRefused(Exception):
    """A move that cannot start or did not finish: `status` and OpenAI-style `code`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Move:
    """A finished move: the node's new role and epoch, as the node answered."""

    node: Node
    previous: Role
    result: RoleChangeResult
    reason: str


class RoleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.moves = Counter(
            "pdserve_proxy_role_moves_total",
            "Nodes moved between pools, by source and destination role, trigger (admin, "
            "planner) and outcome (moved, failed)",
            ["from_role", "to_role", "trigger", "outcome"],
            registry=registry,
        )


class RoleMover:
    def __init__(
        self,
        registry: NodeRegistry,
        client: NodeClient,
        metrics: RoleMetrics | None = None,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.registry = registry
        self.client = client
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s

    def check(self, url: str, role: str) -> tuple[Node, Role]:
        """The node and role of a move that may start now; MoveRefused why not."""
        try:
            node = self.registry.get(normalize_url(url))
            target = Role(role)
        except ValueError as e:
            raise MoveRefused(400, "invalid_request", str(e)) from None
        if node is None:
            raise MoveRefused(404, "node_not_found", f"no node {url} is registered")
        if target not in SWITCHABLE_ROLES or node.role not in SWITCHABLE_ROLES:
            raise MoveRefused(
                409, "fixed_role", f"only prefill and decode nodes change role ({node.url} is "
                f"{node.role.value}, asked for {target.value})",
            )  # fmt: skip
        if node.state is None or not node.state.switchable:
            raise MoveRefused(409, "fixed_role", f"{node.url} does not report a switchable role")
        if node.moving_to is not None:
            raise MoveRefused(409, "role_change_in_progress", f"{node.url} is being moved")
        if target is node.role:
            raise MoveRefused(409, "same_role", f"{node.url} already serves as {target.value}")
        if not [n for n in self.registry.healthy(node.role) if n is not node]:
            raise MoveRefused(
                409, "last_node", f"{node.url} is the last healthy {node.role.value} node"
            )
        return node, target

    async def move(
        self,
        url: str,
        role: str,
        reason: str,
        trigger: str = "admin",
        drain_timeout_s: float | None = None,
    ) -> Move:
        """Move the node at `url` to `role` (see the module doc); MoveRefused if refused or
        failed (the node then serves on in its old role)."""
        node, target = self.check(url, role)
        previous = node.role
        drain = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        msg = RoleChange(
            role="prefill" if target is Role.PREFILL else "decode",
            epoch=node.epoch,
            drain_timeout_s=drain,
        )
        log.info("moving %s from %s to %s: %s", node.url, previous.value, target.value, reason)
        self.registry.begin_move(node, target)
        try:
            result = await self.client.change_role(node.url, msg, drain + CALL_MARGIN_S)
        except BackendError as e:
            await self.registry.end_move(node, None)
            self._count(previous, target, trigger, "failed")
            log.warning("moving %s to %s failed: %s", node.url, target.value, e.message)
            raise MoveRefused(e.status, e.code or "role_change_failed", e.message) from None
        except BaseException:
            node.moving_to = None  # cancelled: the next poll tells where it is
            raise
        await self.registry.end_move(node, Role(result.role))
        self._count(previous, target, trigger, "moved")
        log.info(
            "moved %s from %s to %s: epoch %d, drained in %.2f s, %d requests moved on by the "
            "drain timeout; reason: %s",
            node.url, previous.value, result.role, result.epoch, result.drained_s,
            result.evicted, reason,
        )  # fmt: skip
        return Move(node, previous, result, reason)

    def _count(self, previous: Role, target: Role, trigger: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.moves.labels(previous.value, target.value, trigger, outcome).inc()
