"""The edge: at most max_active requests inside and only what the pre-decode budget has room
for, a bounded FIFO of waiters, 503 with Retry-After beyond it or beyond a request's
patience, and waiters that leave (cancelled) without taking a slot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import pytest
from prometheus_client import CollectorRegistry

from proxy.edge import DrainRate, EdgeConfig, EdgeMetrics, EdgeQueue
from proxy.http.backend import BackendError
from proxy.pool.budget import Limits, PreDecodeBudget


def _queue(
    max_active: int,
    capacity: int,
    budget: PreDecodeBudget | None = None,
    deadline_s: float = 0.0,
) -> EdgeQueue:
    config = EdgeConfig(max_active, capacity, 2.0, deadline_s)
    return EdgeQueue(config, EdgeMetrics(CollectorRegistry()), budget)


def _rejections(edge: EdgeQueue, reason: str) -> float:
    return edge.metrics.rejections.labels(reason)._value.get()


class _Users:
    """Requests that enter through `edge` (in the order they were let in: `inside`) and
    stay there until `done` is set; `on_enter(name, prompt)` runs as each enters."""

    def __init__(self, edge: EdgeQueue, on_enter: Callable[[str, list[int]], None] | None = None):
        self.edge, self.on_enter = edge, on_enter
        self.inside: list[str] = []
        self.done = asyncio.Event()
        self.tasks: list[asyncio.Future[None]] = []

    def start(self, name: str, prompt: list[int]) -> None:
        self.tasks.append(asyncio.ensure_future(self._user(name, prompt)))

    async def _user(self, name: str, prompt: list[int]) -> None:
        async with self.edge.slot(name, prompt):
            self.inside.append(name)
            if self.on_enter is not None:
                self.on_enter(name, prompt)
            await self.done.wait()

    async def finish(self) -> None:
        self.done.set()
        await asyncio.gather(*self.tasks)


def test_slots_pass_to_waiters_in_order_and_overflow_is_refused() -> None:
    async def body() -> None:
        edge = _queue(max_active=2, capacity=2)
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abcd"}

        async def user(name: str) -> None:
            async with edge.slot(name):
                order.append(name)
                await release[name].wait()

        tasks = {n: asyncio.ensure_future(user(n)) for n in "abcd"}
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and edge.active == 2 and edge.depth == 2
        with pytest.raises(BackendError) as err:
            async with edge.slot("e"):
                pass
        assert err.value.status == 503 and err.value.retry_after == 2.0
        assert err.value.reject_reason == "full" and _rejections(edge, "full") == 1
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

        async def user(name: str) -> None:
            async with edge.slot(name):
                await hold.wait()

        first = asyncio.ensure_future(user("a"))
        waiter = asyncio.ensure_future(user("b"))
        await asyncio.sleep(0.01)
        assert edge.depth == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert edge.depth == 0 and edge.active == 1
        hold.set()
        await first
        assert edge.active == 0
        async with edge.slot("c"):  # free again
            assert edge.active == 1

    asyncio.run(body())


def test_a_waiter_cancelled_just_as_it_is_handed_the_slot_gives_it_back() -> None:
    async def body() -> None:
        edge = _queue(max_active=1, capacity=4)
        hold = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []

        async def first_holder() -> None:
            async with edge.slot("a"):
                await hold.wait()
            tasks[1].cancel()  # in the same step as the hand-over, before the waiter runs

        async def waiter() -> None:
            async with edge.slot("b"):
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


def test_a_request_waits_at_the_edge_until_the_pre_decode_stage_has_room() -> None:
    """The pipeline may have slots left, but a request gets in only when the requests ahead
    of it have left the pre-decode stage (a decode node took them) far enough: by count and
    by prompt tokens; an empty stage takes any request."""

    async def body() -> None:
        limits = Limits(requests=2, tokens=100)
        budget = PreDecodeBudget(lambda: limits)
        edge = _queue(max_active=10, capacity=10, budget=budget)
        inside: list[str] = []
        done = {name: asyncio.Event() for name in "abcd"}

        async def user(name: str, num_tokens: int) -> None:
            async with edge.slot(name, [7] * num_tokens):
                inside.append(name)
                await done[name].wait()

        sizes = {"a": 60, "b": 30, "c": 50, "d": 500}
        tasks = [asyncio.ensure_future(user(n, t)) for n, t in sizes.items()]
        await asyncio.sleep(0.01)
        assert inside == ["a", "b"] and edge.depth == 2  # c's 50 tokens do not fit beside 90
        assert (budget.requests, budget.tokens) == (2, 90)
        budget.release("a")  # a decode node took a: its stream goes on, inside the pipeline
        await asyncio.sleep(0.01)
        assert inside == ["a", "b", "c"] and edge.active == 3 and budget.tokens == 80
        for name in "bc":
            budget.release(name)
        await asyncio.sleep(0.01)
        assert inside[-1] == "d"  # 500 tokens: more than the limit, but the stage was empty
        for event in done.values():
            event.set()
        await asyncio.gather(*tasks)
        assert edge.active == 0 and budget.requests == 0 and budget.tokens == 0

    asyncio.run(body())


def test_prefill_work_beyond_the_backlog_horizon_waits_at_the_edge() -> None:
    """Prompt tokens still to prefill (less what a prefill node has cached) are bounded; a
    request counts until its prefill is done, though it stays pre-decode after."""

    async def body() -> None:
        limits = Limits(requests=10, tokens=None, prefill_tokens=100)
        budget = PreDecodeBudget(lambda: limits, lambda ids: len(ids) - 60 * (ids[0] == 0))
        edge = _queue(max_active=10, capacity=10, budget=budget)
        users = _Users(edge)
        inside = users.inside
        users.start("a", [1] * 80)
        users.start("b", [1] * 40)  # 80 + 40 > 100: waits
        await asyncio.sleep(0.01)
        assert inside == ["a"] and budget.prefill_tokens == 80
        budget.prefilled("a")  # a's first token is out: its KV waits for decode
        await asyncio.sleep(0.01)
        assert inside == ["a", "b"] and (budget.requests, budget.prefill_tokens) == (2, 40)
        users.start("c", [0] * 90)  # 60 cached: 30 to compute
        await asyncio.sleep(0.01)
        assert inside == ["a", "b", "c"] and budget.prefill_tokens == 70
        assert budget.tokens == 80 + 40 + 90  # the decode side counts whole prompts
        await users.finish()
        assert (budget.requests, budget.tokens, budget.prefill_tokens) == (0, 0, 0)

    asyncio.run(body())


def test_each_prefill_node_may_take_one_prompt_beyond_the_backlog_horizon() -> None:
    """Two prefill nodes: a prompt longer than the whole horizon does not hold the other node
    idle; a third prompt waits for room as before."""
    limits = Limits(requests=10, tokens=None, prefill_tokens=100, prefill_nodes=2)
    budget = PreDecodeBudget(lambda: limits)
    budget.hold("long", budget.claim([1] * 300))
    assert budget.fits(budget.claim([1] * 40))  # one prefilling, two nodes
    budget.hold("b", budget.claim([1] * 40))
    assert not budget.fits(budget.claim([1] * 1))  # two prefilling, 340 tokens > 100
    budget.prefilled("long")  # one node free again: it takes the next, whatever its size
    assert budget.fits(budget.claim([1] * 500))
    budget.hold("c", budget.claim([1] * 50))
    assert budget.fits(budget.claim([1] * 10)) and not budget.fits(budget.claim([1] * 11))


def test_a_prompt_a_decode_node_would_prefill_passes_the_prefill_horizon() -> None:
    """A long prompt prefilling fills the horizon; another long one waits for it. A prompt
    the placement would send to a decode node (here: those starting with 9) takes none of the
    prefill pool's room, so it enters at once, past that waiter too; a prompt for the
    prefill pool still waits its turn."""

    async def body() -> None:
        limits = Limits(requests=4, tokens=None, prefill_tokens=100)
        budget = PreDecodeBudget(lambda: limits, local=lambda ids, *_: ids[0] == 9)
        edge = _queue(max_active=10, capacity=10, budget=budget)

        def entered(name: str, prompt: list[int]) -> None:
            if prompt[0] == 9:  # as the backend does once the decode node has taken it
                budget.release(name)

        users = _Users(edge, entered)
        inside = users.inside
        users.start("long", [1] * 300)
        await asyncio.sleep(0.01)
        users.start("long-2", [1] * 300)  # the horizon: waits
        users.start("remote", [1] * 10)  # behind it, FIFO
        users.start("local", [9] * 10)
        await asyncio.sleep(0.01)
        assert inside == ["long", "local"] and edge.depth == 2
        budget.prefilled("long")
        await asyncio.sleep(0.01)
        assert inside == ["long", "local", "long-2"] and edge.depth == 1
        # The request bound (4) is not the prefill pool's: a head waiting for it is passed
        # by no one.
        users.start("long-3", [1] * 300)
        for i in range(2):
            budget.hold(f"other-{i}", budget.claim([1] * 2))
        await asyncio.sleep(0.01)
        assert budget.requests == 4 and edge.depth == 2
        users.start("local-2", [9] * 10)
        await asyncio.sleep(0.01)
        assert not budget.room(budget.claim([9] * 10)) and edge.depth == 3
        for i in range(2):
            budget.release(f"other-{i}")  # room again: the head waits for the horizon only
        await asyncio.sleep(0.01)
        assert inside == ["long", "local", "long-2", "local-2"] and edge.depth == 2
        await users.finish()
        assert inside[4:] == ["remote", "long-3"]
        assert (budget.requests, budget.tokens, budget.prefill_tokens) == (0, 0, 0)

    asyncio.run(body())


def test_a_waiter_for_the_prefill_pool_is_passed_by_waiters_for_a_decode_node() -> None:
    """Room freed elsewhere (a pump) lets waiting prompts for a decode node past a head that
    waits only for the prefill pool; a head that waits for a request slot is passed by none."""
    budget = PreDecodeBudget(lambda: Limits(requests=3, tokens=None, prefill_tokens=100))
    edge = _queue(max_active=10, capacity=10, budget=budget)
    local = {"on": False}
    budget.local = lambda ids, *_: local["on"] and ids[0] == 9

    async def body() -> None:
        users = _Users(edge)
        inside = users.inside
        users.start("long", [1] * 300)
        await asyncio.sleep(0.01)
        for name, prompt in (("long-2", [1] * 300), ("short", [9] * 10), ("short-2", [9] * 5)):
            users.start(name, prompt)
        await asyncio.sleep(0.01)
        assert inside == ["long"] and edge.depth == 3  # no decode node would take them yet
        local["on"] = True  # (a decode node reported room)
        edge.pump()
        await asyncio.sleep(0.01)
        assert inside == ["long", "short", "short-2"] and edge.depth == 1
        await users.finish()
        assert inside[-1] == "long-2"

    asyncio.run(body())


def test_the_placement_is_told_each_waiters_wait_and_the_prefill_work_ahead_of_it() -> None:
    """For `auto`'s TTFT objective: a prompt asked about at the edge has waited so long,
    behind waiters with so many prompt tokens to prefill (the head's included)."""
    budget = PreDecodeBudget(lambda: Limits(requests=8, tokens=None, prefill_tokens=100))
    edge = _queue(max_active=10, capacity=10, budget=budget)
    asked: list[tuple[int, float, int]] = []

    def local(ids: Sequence[int], waited_s: float, ahead_tokens: int) -> bool:
        asked.append((len(ids), waited_s, ahead_tokens))
        return False

    budget.local = local

    async def body() -> None:
        users = _Users(edge)
        users.start("long", [1] * 300)
        await asyncio.sleep(0.01)
        users.start("long-2", [1] * 300)  # waits for the horizon
        await asyncio.sleep(0.01)
        users.start("short", [1] * 10)  # on arrival: behind long-2's 300 tokens, no wait yet
        await asyncio.sleep(0.01)
        assert asked[-1] == (10, 0.0, 300)
        asked.clear()
        await asyncio.sleep(0.05)
        edge.pump()  # room freed elsewhere: each waiter is asked again
        by_len = {n: (w, a) for n, w, a in asked}
        assert by_len[300][0] >= 0.04 and by_len[300][1] == 0  # the head: nothing ahead
        assert by_len[10][0] >= 0.04 and by_len[10][1] == 300
        await users.finish()

    asyncio.run(body())


def test_a_request_whose_estimated_wait_exceeds_its_patience_is_refused_at_once() -> None:
    async def body() -> None:
        edge = _queue(max_active=1, capacity=100, deadline_s=30.0)
        hold = asyncio.Event()

        async def user(name: str, patience_s: float | None = None) -> None:
            async with edge.slot(name, patience_s=patience_s):
                await hold.wait()

        first = asyncio.ensure_future(user("a"))
        waiting = [asyncio.ensure_future(user(f"w{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        assert edge.estimated_wait_s(3) is None  # no drain measured: nobody is refused for it
        start = time.monotonic() - 8
        edge.drain = DrainRate()  # as if requests had waited for 8 s, 9 hand-overs in them
        edge.drain.waiting(start, True)
        for i in range(9):
            edge.drain.admitted(start + i)
        assert edge.estimated_wait_s(3) == pytest.approx(4.0, rel=0.01)
        with pytest.raises(BackendError) as err:  # 4 s ahead, 2 s of patience
            await user("impatient", patience_s=2.0)
        assert err.value.reject_reason == "deadline" and err.value.status == 503
        assert err.value.headers() == {"Retry-After": "4"}  # the queue ahead drains in ~4 s
        patient = asyncio.ensure_future(user("patient", patience_s=10.0))
        await asyncio.sleep(0.01)
        assert edge.depth == 4 and _rejections(edge, "deadline") == 1
        hold.set()
        await asyncio.gather(first, patient, *waiting)

    asyncio.run(body())


def test_a_waiter_whose_patience_runs_out_leaves_with_a_503() -> None:
    async def body() -> None:
        edge = _queue(max_active=1, capacity=4, deadline_s=0.1)
        hold = asyncio.Event()

        async def holder() -> None:
            async with edge.slot("a"):
                await hold.wait()

        first = asyncio.ensure_future(holder())
        await asyncio.sleep(0.01)
        with pytest.raises(BackendError) as err:
            async with edge.slot("b"):
                raise AssertionError("never admitted")
        assert err.value.reject_reason == "expired" and edge.depth == 0
        assert _rejections(edge, "expired") == 1
        hold.set()
        await first
        assert edge.active == 0

    asyncio.run(body())


def test_the_drain_rate_counts_hand_overs_per_second_of_backlog() -> None:
    drain = DrainRate(window=16, max_age_s=30.0, min_samples=3)
    assert drain.rate(0.0) is None
    drain.waiting(0.0, True)
    for t in (0.0, 0.5, 1.0, 1.5, 2.0):
        drain.admitted(t)
    assert drain.rate(2.0) == pytest.approx(2.0)  # 4 gaps in 2 s
    assert drain.rate(4.0) == pytest.approx(1.0)  # still waiting, nothing admitted: it falls
    drain.waiting(4.0, False)  # the queue emptied: idle time does not count
    assert drain.rate(14.0) == pytest.approx(1.0)
    drain.waiting(14.0, True)  # a new backlog, drained at 4 per second
    for t in (14.25, 14.5, 14.75, 15.0):
        drain.admitted(t)
    assert drain.rate(15.0) == pytest.approx(8 / 5)  # 8 gaps in 5 s of backlog
    assert drain.rate(45.0) is None  # all older than 30 s


def test_the_drain_rate_leans_optimistic_when_the_recent_hand_overs_were_slow() -> None:
    """A burst's first seconds drain slowly (the proxy is busy taking it in): the rate of
    everything still recent (4 per second) wins over the last few hand-overs' (1 per s)."""
    drain = DrainRate(window=4, max_age_s=60.0, min_samples=3)
    drain.waiting(0.0, True)
    for i in range(9):  # 8 gaps in 2 s
        drain.admitted(0.25 * i)
    drain.waiting(2.0, False)
    drain.waiting(10.0, True)  # a new burst: 3 hand-overs in 3 s
    for t in (11.0, 12.0, 13.0):
        drain.admitted(t)
    assert drain.rate(13.0) == pytest.approx(11 / 5)  # all 12 within 5 s of backlog
    assert DrainRate(window=4, keep=4, min_samples=3).rate(0.0) is None
