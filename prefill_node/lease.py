"""A held block set under a deadline: what a prefill node keeps between prefill and transfer.

The lease is a value (frozen): extending returns a new lease, so whoever holds
the table of leases decides when the change takes effect. Time is
time.monotonic() seconds unless a `now` is passed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    peer: str | None  # the peer the blocks are promised to, once known
    deadline: float  # monotonic seconds

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("a lease needs a request id")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(f"lease {self.request_id}: duplicate block ids")

    @classmethod
    def grant(
        cls,
        request_id: str,
        block_ids: list[int] | tuple[int, ...],
        ttl_s: float,
        peer: str | None = None,
        now: float | None = None,
    ) -> Lease:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        start = time.monotonic() if now is None else now
        return cls(request_id, tuple(block_ids), peer, start + ttl_s)

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline

    def remaining(self, now: float | None = None) -> float:
        return max(0.0, self.deadline - (time.monotonic() if now is None else now))

    def extend(
        self, ttl_s: float, now: float | None = None, max_deadline: float | None = None
    ) -> Lease:
        """A lease whose deadline is now + ttl_s (never earlier than the current one).

        An expired lease cannot be extended: its blocks may already be freed.
        """
        t = time.monotonic() if now is None else now
        if self.expired(t):
            raise ValueError(f"lease {self.request_id} expired; it cannot be extended")
        deadline = max(self.deadline, t + ttl_s)
        if max_deadline is not None:
            deadline = min(deadline, max_deadline)
        return replace(self, deadline=deadline)

    def with_peer(self, peer: str) -> Lease:
        return replace(self, peer=peer)
