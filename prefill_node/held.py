"""Prefilled requests whose prompt KV a prefill node holds for transfer.

Per request (DESIGN.md §3, prefill side, after COMPUTING):

    HELD(lease) --TransferRequest--> SENDING --transfer done/failed--> RELEASED
      | cancel / lease expiry / decode peer lost ----------------------> RELEASED
    SENDING + cancel: abort the transfer, RELEASED once it is quiescent

The table only tracks states; the node frees blocks (through the engine's
allocator) exactly when an entry reaches RELEASED.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from prefill_node.lease import Lease


class HeldState(str, Enum):
    HELD = "held"
    SENDING = "sending"
    RELEASED = "released"


_LEGAL = {
    HeldState.HELD: frozenset({HeldState.SENDING, HeldState.RELEASED}),
    HeldState.SENDING: frozenset({HeldState.RELEASED}),
    HeldState.RELEASED: frozenset(),
}


@dataclass
class HeldKV:
    request_id: str
    blocks: list[int]
    num_tokens: int
    lease: Lease
    state: HeldState = HeldState.HELD
    peer_id: str | None = None
    cancel_requested: bool = False
    sent_at: float = 0.0
    created: float = field(default_factory=time.monotonic)

    def transition(self, new: HeldState) -> None:
        if new not in _LEGAL[self.state]:
            raise RuntimeError(f"{self.request_id}: illegal {self.state.value} -> {new.value}")
        self.state = new


class HeldTable:
    def __init__(self) -> None:
        self._entries: dict[str, HeldKV] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> HeldKV | None:
        return self._entries.get(request_id)

    def add(self, entry: HeldKV) -> None:
        assert entry.request_id not in self._entries, entry.request_id
        self._entries[entry.request_id] = entry

    def release(self, request_id: str) -> HeldKV | None:
        """Move the entry to RELEASED and forget it; the caller frees its blocks."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            entry.transition(HeldState.RELEASED)
        return entry

    def expired(self, now: float) -> list[HeldKV]:
        """HELD entries past their lease (SENDING ones finish their transfer first)."""
        return [
            e for e in self._entries.values() if e.state is HeldState.HELD and e.lease.expired(now)
        ]

    def sending_to(self, peer_id: str) -> list[HeldKV]:
        return [e for e in self._entries.values() if e.peer_id == peer_id]

    def count(self, state: HeldState) -> int:
        return sum(1 for e in self._entries.values() if e.state is state)

    def entries(self) -> list[HeldKV]:
        return list(self._entries.values())
