"""One record per request an engine holds: its stage, its block set and, for a node role,
its transfer.

    QUEUED <-> RUNNING --hold--> HELD          (prefill role: prompt KV kept for transfer)
      |          ^  |
      |          |  +--ended with pins--> HELD (streamed KV: only the pinned blocks kept)
      +----------|-----ended with pins--> HELD
    RESERVED ----+ admit                       (decode role: KV landed in reserved blocks)

Pins (prefill role, KV streamed while the prompt computes): each full prompt block gets an
extra HELD reference (`pinned`) the step it is computed, because the node may start writing
it at once. The scheduler may then abort, finish or preempt the sequence (freeing its own
references) without freeing a block a write reads: a record that ends with pins stays as a
HELD record until the node releases it, once its transfer is quiescent.

QUEUED and RUNNING are the scheduler's (`seq.status`); HELD and RESERVED are block sets the
engine keeps for a node until it releases them. A record leaves the table when its request
finishes or its blocks are freed. The engine thread alone adds, moves and removes records;
the node's event loop reads them (`LLMEngine.record`) and owns `transfer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.sequence import SeqStatus, Sequence
from common.wire.fsm import Transitions
from common.wire.stage import Stage

MOVES: Transitions[Stage] = Transitions(
    "request",
    {
        Stage.QUEUED: {Stage.RUNNING, Stage.HELD},  # (HELD: ended with pins)
        Stage.RUNNING: {Stage.QUEUED, Stage.HELD},
        Stage.HELD: set(),
        Stage.RESERVED: {Stage.RUNNING},
    },
)


@dataclass(eq=False)
class RequestRecord:
    request_id: str
    seq: Sequence | None = None  # while the scheduler has it (QUEUED or RUNNING)
    blocks: list[int] = field(default_factory=list)  # the HELD or RESERVED block set
    kv_stage: Stage | None = None  # HELD or RESERVED, exactly when seq is None
    # The node role's record of the KV's transfer (prefill: lease and send state; decode:
    # receive state). Read and written on the node's event loop only.
    transfer: object | None = None
    # RESERVED only: how many leading blocks were already cached here (prefix caching):
    # shared, not written, so the transfer skips them.
    num_cached_blocks: int = 0
    # Prefill role, streamed KV: blocks with an extra HELD reference for writes that may
    # read them; freed with the record's kept set, never before (see the module doc).
    pinned: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (self.seq is None) == (self.kv_stage is None):
            raise ValueError(f"{self.request_id}: a record has a sequence or a kept block set")
        if self.kv_stage not in (None, Stage.HELD, Stage.RESERVED):
            raise ValueError(f"{self.request_id}: kept blocks are HELD or RESERVED")

    @property
    def stage(self) -> Stage:
        if self.seq is None:
            assert self.kv_stage is not None
            return self.kv_stage
        return Stage.RUNNING if self.seq.status is SeqStatus.RUNNING else Stage.QUEUED

    def hold(self, blocks: list[int]) -> None:
        """The prompt is computed; keep its KV `blocks` (now HELD) instead of decoding on."""
        assert self.seq is not None, self.request_id  # the scheduler just finished it
        self.kv_stage = MOVES.move(self.request_id, Stage.RUNNING, Stage.HELD)
        self.seq, self.blocks = None, blocks

    def keep_pins(self) -> None:
        """The sequence ended (aborted, finished) with pinned blocks: keep only them."""
        assert self.seq is not None and self.pinned, self.request_id
        self.kv_stage = MOVES.move(self.request_id, self.stage, Stage.HELD)
        self.seq, self.blocks = None, []

    def admit(self, seq: Sequence) -> None:
        """The KV landed in the RESERVED blocks: `seq` (owning them) decodes from here."""
        MOVES.move(self.request_id, self.stage, Stage.RUNNING)
        self.seq, self.blocks, self.kv_stage = seq, [], None
