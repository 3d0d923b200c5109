"""The edge queue: at most max_active requests inside, a bounded FIFO of waiters, 503 with
Retry-After beyond it, and waiters that leave (cancelled) without taking a slot."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from proxy.edge import EdgeConfig, EdgeMetrics, EdgeQueue
from proxy.http.backend import BackendError


def _queue(max_active: int, capacity: int) -> EdgeQueue:
    return EdgeQueue(EdgeConfig(max_active, capacity, 2.0), EdgeMetrics(CollectorRegistry()))


def test_slots_pass_to_waiters_in_order_and_overflow_is_refused() -> None:
    async def body() -> None:
        edge = _queue(max_active=2, capacity=2)
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abcd"}

        async def user(name: str) -> None:
            async with edge.slot():
                order.append(name)
                await release[name].wait()

        tasks = {n: asyncio.ensure_future(user(n)) for n in "abcd"}
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and edge.active == 2 and edge.depth == 2
        with pytest.raises(BackendError) as err:
            async with edge.slot():
                pass
        assert err.value.status == 503 and err.value.retry_after == 2.0
        release["b"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "c"] and edge.active == 2 and edge.depth == 1
        for n in "acd":
            release[n].set()
        await asyncio.gather(*tasks.values())
        assert order == ["a", "b", "c", "d"] and edge.active == 0 and edge.depth == 0

    asyncio.run(body())


def test_a_cancelled_waiter_leaves_without_a_slot() -> None:
    async def body() -> None:
        edge = _queue(max_active=1, capacity=4)
        hold = asyncio.Event()

        async def user() -> None:
            async with edge.slot():
                await hold.wait()

        first = asyncio.ensure_future(user())
        waiter = asyncio.ensure_future(user())
        await asyncio.sleep(0.01)
        assert edge.depth == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert edge.depth == 0 and edge.active == 1
        hold.set()
        await first
        assert edge.active == 0
        async with edge.slot():  # free again
            assert edge.active == 1

    asyncio.run(body())


def test_a_waiter_cancelled_just_as_it_is_handed_the_slot_gives_it_back() -> None:
    async def body() -> None:
        edge = _queue(max_active=1, capacity=4)
        hold = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []

        async def first_holder() -> None:
            async with edge.slot():
                await hold.wait()
            tasks[1].cancel()  # in the same step as the hand-over, before the waiter runs

        async def waiter() -> None:
            async with edge.slot():
                raise AssertionError("the cancelled waiter must not run")

        tasks += [asyncio.ensure_future(first_holder()), asyncio.ensure_future(waiter())]
        await asyncio.sleep(0.01)
        assert edge.depth == 1
        hold.set()
        await tasks[0]
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert edge.active == 0 and edge.depth == 0

    asyncio.run(body())
