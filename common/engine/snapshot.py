"""What the engine thread publishes after each change for every other thread to read
(`LLMEngine.state()`): blocks by state, requests by stage, the prefix cache's counters, and
what a router plans with (queued prompt tokens, the prefill rate, the slowest recent step).

A plain dict, replaced whole: a reader on another thread sees one snapshot or the next."""

from __future__ import annotations

from collections.abc import Iterable

from common.engine.block_allocator import BlockAllocator
from common.engine.records import RequestRecord
from common.engine.scheduler import Scheduler
from common.wire.stage import Stage


def snapshot(
    allocator: BlockAllocator,
    scheduler: Scheduler,
    records: Iterable[RequestRecord],
    counters: dict[str, object],
) -> dict[str, object]:
    """The books as they stand, and the engine's `counters` (measured rates, violations)."""
    stages = [r.stage for r in records]
    return {
        "blocks": allocator.counts(),
        "requests": {
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
            "held": stages.count(Stage.HELD),
            "reserved": stages.count(Stage.RESERVED),
        },
        "prefix_cache": {
            **allocator.cache_counts(),
            "enabled": scheduler.prefix_caching,
            "queried_tokens": scheduler.prefix_queries,
            "hit_tokens": scheduler.prefix_hits,
        },
        "queued_prefill_tokens": scheduler.queued_prefill_tokens(),
        "preemptions": scheduler.num_preemptions,
        **counters,
    }
