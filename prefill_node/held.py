"""The prefill node's record of one request's held KV: its lease and its send state.

It rides on the engine's record of the request (`RequestRecord.transfer`), which owns the
block set; the node reads and writes it on its event loop only. Per request (DESIGN.md §3,
prefill side, after COMPUTING):

    HELD(lease) --TransferRequest--> SENDING --transfer done/failed--> RELEASED
      |                                 | cancel, or the sending deadline: abort the write
      |                                 v
      |                             CANCELLING --quiescent-----------> RELEASED
      | cancel / lease expiry / decode peer lost ----------------------> RELEASED

The node frees the blocks (a release command to the engine) exactly when a record reaches
RELEASED.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from enum import Enum

from common.wire.fsm import Transitions
from prefill_node.lease import Lease


class HeldState(str, Enum):
    HELD = "held"
    SENDING = "sending"
    CANCELLING = "cancelling"  # cancelled while sending: released once the write is quiescent
    RELEASED = "released"


MOVES: Transitions[HeldState] = Transitions(
    "held KV",
    {
        HeldState.HELD: {HeldState.SENDING, HeldState.RELEASED},
        HeldState.SENDING: {HeldState.CANCELLING, HeldState.RELEASED},
        HeldState.CANCELLING: {HeldState.RELEASED},
        HeldState.RELEASED: set(),
    },
)


@dataclass
class HeldKV:
    request_id: str
    num_blocks: int
    num_tokens: int
    lease: Lease
    # The capability a TransferRequest must carry (KVHandle.transfer_key): unguessable.
    transfer_key: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    state: HeldState = HeldState.HELD
    peer_id: str | None = None  # the decode node's agent, once SENDING
    sent_blocks: int = 0  # how many (the decode node may have a prefix cached already)
    sent_at: float = 0.0
    created: float = field(default_factory=time.monotonic)

    def admits(self, transfer_key: str) -> bool:
        """Whether a TransferRequest with `transfer_key` may take this KV (constant time)."""
        return hmac.compare_digest(transfer_key.encode(), self.transfer_key.encode())

    def transition(self, new: HeldState) -> None:
        self.state = MOVES.move(self.request_id, self.state, new)

    @property
    def sending(self) -> bool:
        """A write to the peer is committed and not yet quiescent."""
        return self.state in (HeldState.SENDING, HeldState.CANCELLING)
