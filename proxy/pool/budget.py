"""The pre-decode budget: how much work may be between the edge and the decode pool.

A disaggregated request is *pre-decode* from the moment the edge admits it until a decode
node takes it (its decode stream is accepted), or it ends: it is prefilling, or prefilled and
waiting in the inter-stage queue with its KV held on a prefill node. The edge admits a request
only while the pre-decode stage has room for it, so prefill never computes KV that the
pipeline cannot carry on to decode, and a prefilled request is never refused for lack of
queue room; everything else waits at the edge.

The room follows the decode pool (`decode_limits`): at most as many requests as the healthy
decode nodes run at once (the sum of their `max_num_seqs`, or a configured number) and at most
as many prompt tokens as their KV caches hold. That is one refill of the decode pool waiting,
prefilled, while it works; more would only hold prefill memory longer. An empty stage takes
any one request, however large, so nothing waits for room that cannot appear.

`hold`/`release` are keyed by request id and idempotent; every release tells the listeners
(the edge admits its next waiter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.pool.node_state import Role
from proxy.pool.registry import NodeRegistry


@dataclass(frozen=True)
class Limits:
    requests: int
    tokens: int | None  # None: not known (no decode node has reported its KV size)

    def describe(self) -> str:
        tokens = "unknown" if self.tokens is None else f"{self.tokens}"
        return f"{self.requests} requests, {tokens} prompt tokens"


class PreDecodeBudget:
    def __init__(self, limits: Callable[[], Limits]) -> None:
        self.limits = limits
        self._held: dict[str, int] = {}  # request id -> prompt tokens
        self._tokens = 0
        self._listeners: list[Callable[[], None]] = []

    @property
    def requests(self) -> int:
        return len(self._held)

    @property
    def tokens(self) -> int:
        return self._tokens

    def add_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` is called after every release: there may be room now."""
        self._listeners.append(listener)

    def fits(self, num_tokens: int) -> bool:
        if not self._held:
            return True
        limits = self.limits()
        if len(self._held) >= limits.requests:
            return False
        return limits.tokens is None or self._tokens + num_tokens <= limits.tokens

    def hold(self, request_id: str, num_tokens: int) -> None:
        """Count `request_id` as pre-decode with `num_tokens` (replacing what it held)."""
        self._tokens += num_tokens - self._held.get(request_id, 0)
        self._held[request_id] = num_tokens

    def release(self, request_id: str) -> None:
        """`request_id` left the pre-decode stage (a no-op if it was not in it)."""
        num_tokens = self._held.pop(request_id, None)
        if num_tokens is None:
            return
        self._tokens -= num_tokens
        for listener in self._listeners:
            listener()


def decode_limits(registry: NodeRegistry, max_requests: int = 0) -> Callable[[], Limits]:
    """Limits from the healthy decode nodes' last `/state`: their `max_num_seqs` summed (or
    `max_requests` when > 0) and their KV caches' tokens summed."""

    def limits() -> Limits:
        seqs = kv_tokens = 0
        known = False
        for node in registry.healthy(Role.DECODE):
            state = node.state
            if state is None or state.capacity is None:
                continue
            cap = state.capacity
            seqs += cap.max_num_seqs
            total = state.blocks.get("total", 0)
            if total > 0:
                kv_tokens += total * cap.block_size
                known = True
        requests = max_requests if max_requests > 0 else max(seqs, 1)
        return Limits(requests, kv_tokens if known else None)

    return limits
