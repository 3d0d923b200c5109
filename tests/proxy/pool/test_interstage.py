"""The inter-stage queue against stub nodes over real HTTP: FIFO under a full decode pool,
lease extension while waiting, cancel on removal, overload, expiry, and metrics."""

from __future__ import annotations

import asyncio

import pytest

from proxy.http.backend import BackendError
from proxy.pool.interstage import QueueEntry
from proxy.pool.node_state import Role
from tests.support.node_stubs import (
    Stack,
    StubNode,
    decode_request,
    eventually,
    proxy_stack,
    run,
    stubs,
)


async def _read_all(stack: Stack, entry: QueueEntry) -> list[int]:
    """Wait for the entry's decode stream and read it to the end, as DisaggBackend does."""
    stream = await stack.queue.wait(entry)
    tokens: list[int] = []
    try:
        while True:
            chunk = await stream.next_chunk()
            tokens += chunk.token_ids
            if chunk.finish_reason is not None:
                return tokens
    finally:
        stream.close()
        stack.queue.notify_capacity()


def test_fifo_order_is_kept_while_the_decode_pool_is_full() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        # It reports one slot, so the queue offers one request at a time.
        decode.max_streams, decode.max_num_seqs, decode.hold_streams = 1, 1, True
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            names = ["a", "b", "c", "d"]
            entries = [stack.queue.submit(decode_request(n), prefill.url) for n in names]
            readers = [asyncio.ensure_future(_read_all(stack, e)) for e in entries]
            try:
                await eventually(lambda: decode.accepted == ["a"], what="a accepted")
                await asyncio.sleep(0.2)  # b, c, d are offered and refused meanwhile
                assert decode.accepted == ["a"] and stack.queue.depth == 3
                assert stack.metric("pdserve_interstage_queue_depth") == 3
                for i, name in enumerate(names):
                    await eventually(lambda i=i: decode.accepted == names[: i + 1])
                    decode.release(name)
                    assert await readers[i] == [8, 9, 10]
            finally:
                for task in readers:
                    task.cancel()
            assert decode.accepted == names
            assert stack.queue.depth == 0
            assert stack.metric("pdserve_interstage_wait_seconds_count") == 4
            assert stack.metric("pdserve_interstage_exits_total", outcome="dispatched") == 4
            assert stack.metric("pdserve_interstage_decode_full_total") >= 3
            assert prefill.cancels == []

    run(body())


@pytest.mark.parametrize(
    ("max_num_seqs", "max_offers", "together"), [(8, 8, 4), (2, 8, 2), (8, 1, 1), (0, 8, 1)]
)
def test_offers_go_out_together_while_the_reported_capacity_holds_them(
    max_num_seqs: int, max_offers: int, together: int
) -> None:
    """A decode node answers an offer when its engine has reserved the blocks (a step
    boundary): four queued requests are offered at once when its last /state has room for
    them, as many as it has slots, one at a time with max_offers=1 or no capacity reported
    (max_num_seqs 0)."""

    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.accept_delay, decode.max_num_seqs = 0.3, max_num_seqs
        async with (
            stubs(prefill, decode),
            proxy_stack((prefill,), (decode,), max_offers=max_offers) as stack,
        ):
            await eventually(lambda: stack.registry.healthy(Role.DECODE) != [], what="up")
            names = ["a", "b", "c", "d"]
            entries = [stack.queue.submit(decode_request(n), prefill.url) for n in names]
            got = await asyncio.gather(*(_read_all(stack, e) for e in entries))
            assert got == [[8, 9, 10]] * 4
            assert sorted(decode.accepted) == names
            assert decode.offers_open_max == together
            assert stack.queue.depth == 0 and prefill.cancels == []

    run(body())


def test_decode_full_answers_keep_the_request_queued_until_one_accepts() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.decode_full_times = 3
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            entry = stack.queue.submit(decode_request("r1"), prefill.url)
            assert await _read_all(stack, entry) == [8, 9, 10]
            assert [p for p in decode.paths()] == ["/internal/decode"] * 4
            assert stack.metric("pdserve_interstage_decode_full_total") == 3
            assert stack.metric("pdserve_interstage_wait_seconds_count") == 1

    run(body())


def test_waiting_requests_get_their_leases_extended_in_one_call_per_prefill_node() -> None:
    async def body() -> None:
        p1, p2, decode = StubNode("prefill"), StubNode("prefill"), StubNode("decode")
        decode.max_streams = 0  # always full
        async with stubs(p1, p2, decode), proxy_stack((p1, p2), (decode,), lease_s=0.3) as stack:
            a = stack.queue.submit(decode_request("a"), p1.url)
            b = stack.queue.submit(decode_request("b"), p1.url)
            c = stack.queue.submit(decode_request("c"), p2.url)
            await eventually(lambda: len(p1.extends) >= 3, what="three extensions")
            assert all(sorted(ids) == ["a", "b"] for ids in p1.extends)
            assert all(ids == ["c"] for ids in p2.extends) and p2.extends
            lease_s = [m.lease_s for path, m in p1.calls if path == "/internal/extend"]
            assert set(lease_s) == {0.3}
            for entry in (a, b, c):
                stack.queue.cancel(entry)
            await eventually(lambda: sorted(p1.cancels) == ["a", "b"] and p2.cancels == ["c"])
            assert stack.queue.depth == 0 and decode.accepted == []
            assert stack.metric("pdserve_interstage_exits_total", outcome="cancelled") == 3

    run(body())


def test_a_lease_the_prefill_node_no_longer_holds_fails_the_request() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.max_streams = 0
        prefill.extend_missing = {"gone"}
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,), lease_s=0.3) as stack:
            gone = stack.queue.submit(decode_request("gone"), prefill.url)
            kept = stack.queue.submit(decode_request("kept"), prefill.url)
            with pytest.raises(BackendError) as err:
                await stack.queue.wait(gone)
            assert err.value.status == 502 and "lease" in err.value.message
            await eventually(lambda: prefill.cancels == ["gone"])
            assert stack.queue.depth == 1
            assert stack.metric("pdserve_interstage_exits_total", outcome="expired") == 1
            stack.queue.cancel(kept)

    run(body())


def test_cancelled_entries_leave_the_queue_and_are_cancelled_on_the_prefill_node() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.max_streams = 0
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            x = stack.queue.submit(decode_request("x"), prefill.url)
            y = stack.queue.submit(decode_request("y"), prefill.url)
            waiter = asyncio.ensure_future(stack.queue.wait(y))
            await asyncio.sleep(0.1)
            stack.queue.cancel(x)  # removed by the owner
            waiter.cancel()  # the waiter cancelled (client gone while queued)
            await eventually(lambda: sorted(prefill.cancels) == ["x", "y"], what="cancels")
            assert stack.queue.depth == 0
            decode.max_streams = None  # capacity frees up: nothing is left to dispatch
            stack.queue.notify_capacity()
            await asyncio.sleep(0.1)
            assert decode.accepted == []

    run(body())


def test_an_entry_cancelled_while_offered_drops_the_accepted_stream_on_both_nodes() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.accept_delay, decode.hold_streams = 0.3, True
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            entry = stack.queue.submit(decode_request("r"), prefill.url)
            await eventually(lambda: decode.paths() == ["/internal/decode"], what="offer")
            stack.queue.cancel(entry)
            await eventually(lambda: decode.disconnected == ["r"], what="stream dropped")
            await eventually(lambda: decode.cancels == ["r"] and prefill.cancels == ["r"])
            assert stack.queue.depth == 0

    run(body())


def test_an_entry_waiting_longer_than_max_wait_fails_unavailable() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.max_streams = 0
        async with (
            stubs(prefill, decode),
            proxy_stack((prefill,), (decode,), lease_s=0.3, max_wait_s=0.2) as stack,
        ):
            entry = stack.queue.submit(decode_request("slow"), prefill.url)
            with pytest.raises(BackendError) as err:
                await stack.queue.wait(entry)
            assert err.value.status == 503 and "decode capacity" in err.value.message
            await eventually(lambda: prefill.cancels == ["slow"])

    run(body())


def test_no_healthy_decode_node_keeps_requests_queued_until_one_comes_up() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.health_status = 503
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            entry = stack.queue.submit(decode_request("r"), prefill.url)
            await asyncio.sleep(0.2)
            assert decode.accepted == [] and stack.queue.depth == 1
            decode.health_status = 200  # the poller brings it up; its listener wakes the queue
            assert await asyncio.wait_for(_read_all(stack, entry), 2.0) == [8, 9, 10]

    run(body())
