"""The prefill node's record of one request's held KV: its lease and its send state.

It rides on the engine's record of the request (`RequestRecord.transfer`), which owns the
block set; the node reads and writes it on its event loop only. Per request (DESIGN.md §3,
prefill side, after COMPUTING):

    HELD(lease) --TransferRequest--> SENDING --transfer done/failed--> RELEASED
      |                                 | cancel, or the sending deadline: abort the write
      |                                 v
      |                             CANCELLING --quiescent-----------> RELEASED
      | cancel / lease expiry / decode peer lost ----------------------> RELEASED

Streamed KV (POST /internal/prefill_streamed) starts earlier, while the prompt computes:

    COMPUTING --TransferRequest--> STREAMING --first token: last group--> SENDING
      | first token, no request yet --> HELD  | cancel / finished at the first token /
      | cancel / finished / call gone          |   call gone: abort the write --> CANCELLING
      +--> RELEASED                            | the write ended early --> RELEASED

In STREAMING each group of blocks the engine completes (and pins) is written at once.

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
    COMPUTING = "computing"  # streamed: the prompt computes, no destination yet
    STREAMING = "streaming"  # streamed: computing, its finished groups written as they come
    HELD = "held"
    SENDING = "sending"
    CANCELLING = "cancelling"  # cancelled while sending: released once the write is quiescent
    RELEASED = "released"


MOVES: Transitions[HeldState] = Transitions(
    "held KV",
    {
        HeldState.COMPUTING: {HeldState.HELD, HeldState.STREAMING, HeldState.RELEASED},
        HeldState.STREAMING: {HeldState.SENDING, HeldState.CANCELLING, HeldState.RELEASED},
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
    stream: StreamedKV | None = None  # streamed KV only

    @classmethod
    def streamed(cls, request_id: str, num_blocks: int, num_tokens: int, lease: Lease) -> HeldKV:
        """The record of a streamed prefill, from its admission on."""
        return cls(request_id, num_blocks, num_tokens, lease, state=HeldState.COMPUTING,
                   stream=StreamedKV())  # fmt: skip

    def admits(self, transfer_key: str) -> bool:
        """Whether a TransferRequest with `transfer_key` may take this KV (constant time)."""
        return hmac.compare_digest(transfer_key.encode(), self.transfer_key.encode())

    def transition(self, new: HeldState) -> None:
        self.state = MOVES.move(self.request_id, self.state, new)

    @property
    def sending(self) -> bool:
        """A write to the peer is committed and not yet quiescent."""
        return self.state in (HeldState.SENDING, HeldState.CANCELLING, HeldState.STREAMING)

    @property
    def computing(self) -> bool:
        """The engine still computes the prompt (streamed KV)."""
        return self.state in (HeldState.COMPUTING, HeldState.STREAMING)


@dataclass
class StreamedKV:
    """What a streamed prefill knows of its KV and its destination.

    Positions are block indexes in the prompt; the decode node has the first `skip_blocks`
    already and reserved `dst_block_ids` for the rest, in order.
    """

    computed: list[int] = field(default_factory=list)  # pinned blocks, by position
    dst_block_ids: list[int] = field(default_factory=list)
    skip_blocks: int = 0
    sent: int = 0  # positions [0, sent) are written (or skipped)
    groups: int = 0  # writes posted
    opened: bool = False  # the streamed write exists in the agent
    first_token: int | None = None
    sampled_at: float = 0.0  # wall clock, when the first token came

    def next_group(self, blocks: list[int]) -> tuple[list[int], list[int]]:
        """(source, destination) block ids of `blocks` (by position) not yet written."""
        start = max(self.sent, self.skip_blocks)
        src = blocks[start:]
        dst = self.dst_block_ids[start - self.skip_blocks : start - self.skip_blocks + len(src)]
        return src, dst
