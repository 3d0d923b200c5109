"""Prefill role, KV streamed while the prompt computes (`stream_kv`): the step that completes
a full prompt block pins it (an extra HELD reference, `RequestRecord.pinned`) and reports it
(a KV_COMPUTED output), so that the node may start writing it at once. Why the pins outlive
the sequence (abort, finish, preemption): records.py."""

from __future__ import annotations

from common.engine.block_allocator import BlockAllocator, BlockState
from common.engine.records import RequestRecord
from common.engine.scheduler import OutputKind, ScheduledBatch, StepOutput
from common.engine.sequence import SeqStatus


def pin_computed(
    batch: ScheduledBatch,
    records: dict[str, RequestRecord],
    allocator: BlockAllocator,
    block_size: int,
) -> list[StepOutput]:
    """Pin the full prompt blocks this step completed of each streamed sequence still
    prefilling (the positions past those pinned before); one output per sequence that got
    new ones."""
    outputs: list[StepOutput] = []
    for seq in batch.seqs:
        if not seq.stream_kv or seq.status is not SeqStatus.RUNNING or not seq.num_uncomputed:
            continue
        record = records[seq.request_id]
        new = seq.block_table[len(record.pinned) : seq.num_computed_tokens // block_size]
        if new:
            allocator.share(new, BlockState.HELD)
            record.pinned += new
            out = StepOutput(
                seq.request_id, [], False, kind=OutputKind.KV_COMPUTED, computed_blocks=new
            )
            outputs.append(out)
    return outputs
