"""Decode role: destination blocks reserved for KV another node writes, and the admission
of a request once its KV has landed in them.

    reserve(request, tokens) -> RESERVED record, its blocks (cached prompt blocks shared)
    admit(seq)               -> the blocks become the sequence's (USED), which decodes on

The engine thread owns these books, or a thread holding the engine's books lock while the
engine thread runs a forward pass (`LLMEngine.reserve_now`). A reservation counts against
max_num_seqs like a running sequence, and never takes the scheduler's watermark, so that
running sequences can still grow.
"""

from __future__ import annotations

import time

from common.engine.block_allocator import BlockAllocator, BlockState
from common.engine.records import RequestRecord
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence
from common.wire.stage import Stage


class Reservations:
    def __init__(
        self,
        allocator: BlockAllocator,
        scheduler: Scheduler,
        records: dict[str, RequestRecord],
        max_num_seqs: int,
    ) -> None:
        self.allocator, self.scheduler = allocator, scheduler
        self.records = records  # the engine's table (shared, not copied)
        self.max_num_seqs = max_num_seqs

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        prompt_token_ids: list[int] | None = None,
        choices: int = 1,
    ) -> list[int] | None:
        """Reserve destination blocks for `num_tokens` of incoming KV, or None if full.

        With the prompt, the leading blocks this node has cached are shared rather than
        reserved empty (the record's num_cached_blocks): the transfer skips them.
        `choices` (n > 1): the sequences it becomes, each with its own copy of the
        prompt's last block (the copies are allocated at the fork, checked for here)."""
        need = -(-num_tokens // self.scheduler.block_size)
        busy = len(self.scheduler.running) + self.count()
        if request_id in self.records or busy + choices > self.max_num_seqs:
            return None
        hits = self.scheduler.cached_prompt_blocks(prompt_token_ids or [])[:need]
        revived = sum(1 for b in hits if self.allocator.is_cached_free(b))
        fresh = need - len(hits)
        copies = choices - 1
        if not self.allocator.can_allocate(fresh + revived + copies + self.scheduler.watermark):
            return None
        self.allocator.share(hits, BlockState.RESERVED)
        blocks = hits + self.allocator.allocate(fresh, BlockState.RESERVED)
        record = RequestRecord(request_id, None, blocks, Stage.RESERVED)
        record.num_cached_blocks = len(hits)
        self.records[request_id] = record
        return blocks

    def count(self) -> int:
        """Reservations whose KV has not landed yet."""
        return sum(1 for r in self.records.values() if r.stage is Stage.RESERVED)

    def admit(self, seq: Sequence) -> None:
        """The KV of `seq`'s prompt is in its reservation: the blocks become the sequence's
        and it joins the running batch, one token (the first, sampled elsewhere) to go."""
        record = self.records[seq.request_id]
        self.allocator.transition(record.blocks, BlockState.USED, BlockState.RESERVED)
        seq.block_table = record.blocks
        seq.num_computed_tokens = seq.num_tokens - 1  # all but the first token's KV
        seq.scheduled_time = time.time()
        record.admit(seq)
        self.scheduler.add_running(seq)
        self.scheduler.register_computed(seq)  # the landed prompt blocks can be shared now
