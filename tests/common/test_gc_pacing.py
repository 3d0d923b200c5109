"""The paced garbage collector (common/gc_pacing.py): it takes over from CPython's, collects
cyclic garbage on its timer, and gives collection back when stopped."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from prometheus_client import CollectorRegistry

from common.gc_pacing import FULL_EVERY, MIDDLE_EVERY, PacedCollector


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_cyclic_garbage_is_collected_on_the_timer_and_collection_is_given_back() -> None:
    async def body() -> None:
        collector = PacedCollector(interval_s=0.02)
        collector.start()
        try:
            assert not gc.isenabled()
            with pytest.raises(RuntimeError):
                collector.start()
            a, b = _Node(), _Node()
            a.other, b.other = b, a  # a cycle: reference counting alone never frees it
            gone = weakref.ref(a)
            del a, b
            for _ in range(200):
                if gone() is None:
                    break
                await asyncio.sleep(0.01)
            assert gone() is None
            assert collector.collections >= 1 and collector.pause_s_max > 0
        finally:
            await collector.stop()
        assert gc.isenabled()
        await collector.stop()  # a second stop does nothing

    gc.enable()
    try:
        asyncio.run(body())
    finally:
        gc.unfreeze()  # start froze this test process's objects


def test_the_generations_follow_cpythons_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: seen.append(generation) or 0)
    collector = PacedCollector()
    for _ in range(FULL_EVERY):
        collector.collect()
    assert seen.count(2) == 1 and seen[-1] == 2
    assert seen.count(1) == FULL_EVERY // MIDDLE_EVERY - 1
    assert seen[MIDDLE_EVERY - 1] == 1 and seen.count(0) == FULL_EVERY - FULL_EVERY // MIDDLE_EVERY


def test_each_collection_is_in_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "collect", lambda generation=2: 3)
    registry = CollectorRegistry()
    collector = PacedCollector(registry=registry)
    for _ in range(MIDDLE_EVERY):
        collector.collect()

    def sample(name: str, generation: int) -> float | None:
        return registry.get_sample_value(name, {"generation": str(generation)})

    assert sample("pdserve_gc_pause_seconds_count", 0) == MIDDLE_EVERY - 1
    assert sample("pdserve_gc_pause_seconds_count", 1) == 1
    assert sample("pdserve_gc_collected_objects_total", 0) == 3 * (MIDDLE_EVERY - 1)


def test_a_collector_that_did_not_find_gc_enabled_leaves_it_disabled() -> None:
    async def body() -> None:
        collector = PacedCollector(interval_s=1.0)
        collector.start()
        await collector.stop()

    gc.disable()
    try:
        asyncio.run(body())
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


@pytest.mark.parametrize("interval_s", [0.0, -1.0, 61.0])
def test_an_interval_out_of_range_is_refused(interval_s: float) -> None:
    with pytest.raises(ValueError):
        PacedCollector(interval_s)
