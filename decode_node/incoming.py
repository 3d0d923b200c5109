"""The decode node's record of one request's incoming KV, from reservation until it lands.

It rides on the engine's record of the request (`RequestRecord.transfer`), which owns the
reserved block set; the node reads and writes it on its event loop only. Per request
(DESIGN.md §3, decode side, before RUNNING):

    RESERVED --TransferRequest sent--> RECEIVING --KVReceived--> LANDED (admitted: RUNNING)
      | cancel                           | cancel: Abort sent  -> CANCELLING --terminal--> FREED
      v                                  | handler gone: Abort -> ABANDONED  --terminal--> FREED
    CANCELLED --handler returns--> FREED | failed / peer lost (quiescent) ---------------> FREED

`done` resolves with True (landed) or False (the transfer ended without landing) once the
KV-transfer layer reports a terminal event, or False early when it reports the sender lost
(TransferLost: the request fails, the blocks stay quarantined until `quiescent`). Blocks are
freed (FREED) only when no write can land in them any more; from LANDED on they belong to
the running sequence.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum

from common.wire.fsm import Transitions


class IncomingState(str, Enum):
    RESERVED = "reserved"
    CANCELLED = "cancelled"  # the proxy cancelled before the transfer started
    RECEIVING = "receiving"
    CANCELLING = "cancelling"  # the proxy cancelled mid-transfer: aborted, not yet quiescent
    ABANDONED = "abandoned"  # no handler waits any more: free on the terminal event
    LANDED = "landed"
    FREED = "freed"


MOVES: Transitions[IncomingState] = Transitions(
    "incoming KV",
    {
        IncomingState.RESERVED: {
            IncomingState.RECEIVING,
            IncomingState.CANCELLED,
            IncomingState.FREED,
        },
        IncomingState.CANCELLED: {IncomingState.FREED},
        IncomingState.RECEIVING: {
            IncomingState.LANDED,
            IncomingState.CANCELLING,
            IncomingState.ABANDONED,
            IncomingState.FREED,
        },
        # A write that lands despite the abort is still admitted (the proxy closes the stream).
        IncomingState.CANCELLING: {
            IncomingState.LANDED,
            IncomingState.ABANDONED,
            IncomingState.FREED,
        },
        IncomingState.ABANDONED: {IncomingState.FREED},
        IncomingState.LANDED: set(),
        IncomingState.FREED: set(),
    },
)

# States in which a write may still land in the reserved blocks.
IN_FLIGHT = frozenset({IncomingState.RECEIVING, IncomingState.CANCELLING, IncomingState.ABANDONED})


@dataclass
class Incoming:
    request_id: str
    num_blocks: int
    done: asyncio.Future[bool]
    state: IncomingState = IncomingState.RESERVED
    peer_id: str | None = None
    failure: str = ""
    quiescent: bool = False  # the layer's terminal event came: nothing can land any more
    skip_blocks: int = 0  # leading blocks already cached here: not transferred
    # Streamed KV: the first token, from the prefill node that owns the transfer (checked),
    # and when it was sampled there (its wall clock); None when the DecodeRequest had it.
    first_token: asyncio.Future[int] | None = None
    sampled_at: float = 0.0
    groups: int = 0  # streamed KV: writes landed before the last one
    progress_at: float = 0.0  # monotonic: the transfer's start, or its last group landed
    events: list[tuple[str, float]] = field(default_factory=list)  # for the trace
    created: float = field(default_factory=time.monotonic)

    def transition(self, new: IncomingState) -> None:
        self.state = MOVES.move(self.request_id, self.state, new)

    @property
    def cancelled(self) -> bool:
        return self.state in (IncomingState.CANCELLED, IncomingState.CANCELLING)

    @property
    def pending(self) -> bool:
        """The node still owns the reservation (not landed, not freed)."""
        return self.state not in (IncomingState.LANDED, IncomingState.FREED)
