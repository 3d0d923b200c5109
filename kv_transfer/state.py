"""Transfer records and their states. A state changes only through transition().

Sender side, one OutgoingTransfer per write():

    QUEUED ──post──> POSTED ──backend done──> DONE
      │                │ abort ──> ABORTING ──> DONE (landed anyway) | ABORTED | FAILED
      │ abort ───────────────────────────────────────────────────────> ABORTED
      └ peer lost / close ───> FAILED <─── peer lost / backend error ──┘

A streamed write (write(final=False), then write_more()) is one record whose segments are
posted one after the other: a segment done with more given goes POSTED -> QUEUED, with none
given yet POSTED -> IDLE (nothing in flight; write_more() queues the next: IDLE -> QUEUED,
abort / peer lost: IDLE -> ABORTED | FAILED). Only the final segment's completion is DONE;
an aborted stream whose posted segment completes is ABORTED.

Receiver side, one IncomingTransfer per request_transfer():

    EXPECTED ──notification──> LANDED
      │ abort ──> ABORT_REQUESTED ──> LANDED | ABORTED | FAILED
      ├ KVAborted from the sender ──> ABORTED
      ├ peer lost / close ──> FAILED
      └ peer lost, one-sided backend ──> QUARANTINED ──> LANDED | ABORTED | FAILED
        (a live sender's write may still land: the blocks stay held until the sender says
        no write is in progress, its incarnation is replaced, or the quarantine times out)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from common.wire.fsm import IllegalTransition as IllegalTransition  # raised by transition()
from common.wire.fsm import Transitions


class OutState(str, Enum):
    QUEUED = "queued"
    POSTED = "posted"
    IDLE = "idle"  # a streamed write between segments: nothing posted, more to come
    ABORTING = "aborting"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


class InState(str, Enum):
    EXPECTED = "expected"
    ABORT_REQUESTED = "abort_requested"
    QUARANTINED = "quarantined"
    LANDED = "landed"
    ABORTED = "aborted"
    FAILED = "failed"


class AbortOrigin(str, Enum):
    NONE = "none"
    LOCAL = "local"  # the owner called abort(): its terminal event is Quiescent
    PEER = "peer"  # the other side sent Abort


_OUT: Transitions[OutState] = Transitions(
    "outgoing transfer",
    {
        OutState.QUEUED: frozenset({OutState.POSTED, OutState.ABORTED, OutState.FAILED}),
        OutState.POSTED: frozenset(
            {OutState.DONE, OutState.ABORTING, OutState.FAILED, OutState.QUEUED, OutState.IDLE}
        ),
        OutState.IDLE: frozenset({OutState.QUEUED, OutState.ABORTED, OutState.FAILED}),
        OutState.ABORTING: frozenset({OutState.DONE, OutState.ABORTED, OutState.FAILED}),
        OutState.DONE: frozenset(),
        OutState.ABORTED: frozenset(),
        OutState.FAILED: frozenset(),
    },
)

_IN: Transitions[InState] = Transitions(
    "incoming transfer",
    {
        InState.EXPECTED: frozenset(
            {
                InState.LANDED,
                InState.ABORT_REQUESTED,
                InState.ABORTED,
                InState.FAILED,
                InState.QUARANTINED,
            }
        ),
        InState.ABORT_REQUESTED: frozenset(
            {InState.LANDED, InState.ABORTED, InState.FAILED, InState.QUARANTINED}
        ),
        InState.QUARANTINED: frozenset({InState.LANDED, InState.ABORTED, InState.FAILED}),
        InState.LANDED: frozenset(),
        InState.ABORTED: frozenset(),
        InState.FAILED: frozenset(),
    },
)


@dataclass(eq=False, slots=True)
class OutgoingTransfer:
    request_id: str
    peer_id: str
    src_ids: np.ndarray  # int32 local block ids
    dst_ids: np.ndarray  # int32 block ids in the peer's cache
    nbytes: int
    state: OutState = OutState.QUEUED
    abort_origin: AbortOrigin = AbortOrigin.NONE
    handle: Any = None  # the backend's in-flight object while POSTED / ABORTING
    created_at: float = field(default_factory=time.monotonic)
    # Streamed writes: whether the segment in src_ids/dst_ids is the last one, and the
    # segments given after it, not yet posted: (src_ids, dst_ids, final).
    final: bool = True
    pending: deque[tuple[np.ndarray, np.ndarray, bool]] = field(default_factory=deque)

    @property
    def terminal(self) -> bool:
        return _OUT.terminal(self.state)

    def next_segment(self) -> None:
        """Load the oldest pending segment (the posted one completed) and queue it."""
        self.src_ids, self.dst_ids, self.final = self.pending.popleft()
        self.transition(OutState.QUEUED)

    def transition(self, new: OutState) -> None:
        self.state = _OUT.move(self.request_id, self.state, new)


@dataclass(eq=False, slots=True)
class IncomingTransfer:
    request_id: str
    peer_id: str
    dst_ids: np.ndarray
    state: InState = InState.EXPECTED
    created_at: float = field(default_factory=time.monotonic)
    aborted_locally: bool = False  # the owner called abort(): its terminal event is Quiescent
    landed_blocks: int = 0  # a streamed transfer lands in several writes: blocks in so far

    @property
    def terminal(self) -> bool:
        return _IN.terminal(self.state)

    @property
    def abort_requested(self) -> bool:
        return self.state is InState.ABORT_REQUESTED

    @property
    def open(self) -> bool:
        """Bytes of it may still be accepted (expected, not quarantined, not ended)."""
        return self.state in (InState.EXPECTED, InState.ABORT_REQUESTED)

    def transition(self, new: InState) -> None:
        self.state = _IN.move(self.request_id, self.state, new)
