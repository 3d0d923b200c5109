"""Hung is not dead (issue 16), against stub nodes that can hang like a stopped process (TCP
still accepts, nothing answers): a stream silent after its first token is stalled; a node
whose polls go unanswered stops getting work, then is marked down and everything waiting on
it ends at once (its streams, the decode streams waiting for its KV, prefill calls, queued
entries whose KV it holds); a Cancel to a hung node is delivered when it answers again; the
backend continues a stalled stream on another decode node with the same tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from common.wire.node_messages import PrefillRequest
from common.wire.sampling_params import SamplingParams
from proxy.http.backend import GenerationRequest, NodeLost
from proxy.pool.client import DECODE_PATH, NodeClient, NodeUnreachable
from proxy.pool.disagg import DisaggBackend
from proxy.pool.node_state import NodeStatus, Role
from proxy.trace import TraceStore
from tests.support.node_stubs import (
    FAST,
    StubNode,
    decode_request,
    eventually,
    proxy_stack,
    run,
    stubs,
)

QUICK = dataclasses.replace(FAST, control_s=0.5, stall_s=0.3)


def test_a_stream_silent_after_its_first_line_is_stalled_but_the_first_may_take_longer() -> None:
    async def body() -> None:
        decode = StubNode("decode")
        decode.hold_streams = True  # the first line waits (a KV transfer, say)
        decode.tokens = [8, 9, 10, 11]
        decode.token_delay = 0.1  # each line after the gate: the hang comes before the second
        async with stubs(decode):
            client = NodeClient(QUICK)
            await client.start()
            try:
                stream = await client.open_stream(
                    decode.url, DECODE_PATH, decode_request("r1"), "r1"
                )
                first = asyncio.ensure_future(stream.next_chunk())
                await asyncio.sleep(0.6)  # twice the stall timeout: the first is exempt
                assert not first.done()
                decode.release("r1")
                assert (await first).token_ids == [8]
                decode.hang()
                started = time.monotonic()
                with pytest.raises(NodeLost) as lost:
                    await stream.next_chunk()
                assert lost.value.cause == "stalled" and lost.value.url == decode.url
                assert 0.25 < time.monotonic() - started < 3.0
                stream.close()
                decode.resume()
                await eventually(lambda: "r1" in decode.disconnected, what="disconnect")
            finally:
                await client.close()

    run(body())


def test_abort_ends_the_streams_and_calls_waiting_on_a_lost_node_and_nothing_else() -> None:
    async def body() -> None:
        prefill, d0, d1 = StubNode("prefill"), StubNode("decode"), StubNode("decode")
        prefill.prefill_delay = 30.0
        d0.hold_streams = d1.hold_streams = True
        async with stubs(prefill, d0, d1):
            client = NodeClient(FAST)
            await client.start()
            try:
                msg = PrefillRequest(
                    request_id="p1",
                    prompt_token_ids=[1, 2],
                    sampling=SamplingParams(max_tokens=2),
                    lease_s=30.0,
                )
                call = asyncio.ensure_future(client.prefill(prefill.url, msg))
                waiting = await client.open_stream(
                    d0.url, DECODE_PATH, decode_request("a"), "a", kv_from=prefill.url
                )
                other = await client.open_stream(d1.url, DECODE_PATH, decode_request("b"), "b")
                await eventually(lambda: prefill.paths() == ["/internal/prefill"])
                assert client.abort(prefill.url, "no answer to polls") == 2
                with pytest.raises(NodeUnreachable) as down:
                    await call
                assert down.value.maybe_received  # the caller cancels it there too
                with pytest.raises(NodeLost) as lost:
                    await waiting.next_chunk()
                assert lost.value.cause == "node_down" and "its KV" in lost.value.message
                d1.release("b")
                assert (await other.next_chunk()).token_ids[0] == 8  # not on the lost node
                other.close()
                waiting.close()
                assert client.abort(prefill.url, "again") == 0
            finally:
                await client.close()

    run(body())


def test_an_aborted_call_leaves_its_task_uncancelled_and_a_real_cancel_still_cancels() -> None:
    """A guarded call runs in its caller's task: `abort` cancels that task and the guard
    takes the cancellation back as NodeUnreachable, so the caller goes on (awaits more) as
    if nothing cancelled it; a cancellation of the task itself stays a cancellation, also
    when an abort comes at the same moment."""

    async def body() -> None:
        prefill = StubNode("prefill")
        prefill.prefill_delay = 30.0
        async with stubs(prefill):
            client = NodeClient(FAST)
            await client.start()
            try:

                def msg(rid: str) -> PrefillRequest:
                    sampling = SamplingParams(max_tokens=2)
                    return PrefillRequest(
                        request_id=rid, prompt_token_ids=[1, 2], sampling=sampling, lease_s=30.0
                    )

                async def caller(rid: str) -> tuple[str, int]:
                    try:
                        await client.prefill(prefill.url, msg(rid))
                    except NodeUnreachable as e:
                        await asyncio.sleep(0.01)  # not cancelled: it awaits on
                        task = asyncio.current_task()
                        assert task is not None
                        return e.message, task.cancelling()
                    raise AssertionError("the call was not ended")

                aborted = asyncio.ensure_future(caller("p1"))
                await eventually(lambda: prefill.paths() == ["/internal/prefill"])
                assert client.abort(prefill.url, "no answer to polls") == 1
                message, cancelling = await aborted
                assert "down: no answer to polls" in message and cancelling == 0

                cancelled = asyncio.ensure_future(caller("p2"))
                both = asyncio.ensure_future(caller("p3"))
                await eventually(lambda: len(prefill.paths()) == 3)
                cancelled.cancel()
                both.cancel()
                assert client.abort(prefill.url, "at the same moment") == 2
                for task in (cancelled, both):
                    with pytest.raises(asyncio.CancelledError):
                        await task
                assert client.abort(prefill.url, "again") == 0  # no guard left behind
            finally:
                await client.close()

    run(body())


def test_a_cancel_to_a_hung_node_is_delivered_when_it_answers_again() -> None:
    async def body() -> None:
        node = StubNode("decode")
        async with stubs(node):
            client = NodeClient(QUICK)
            await client.start()
            try:
                node.hang()
                client.cancel_soon(node.url, "r1")
                await asyncio.sleep(1.5)  # a few attempts time out
                assert node.cancels == []
                node.resume()
                await eventually(lambda: "r1" in node.cancels, 10.0, "the cancel")
            finally:
                await client.close()

    run(body())


def test_a_hung_node_gets_no_new_work_then_goes_down_and_its_work_moves() -> None:
    async def body() -> None:
        prefill, d0, d1 = StubNode("prefill"), StubNode("decode"), StubNode("decode")
        d0.hold_streams = True
        async with (
            stubs(prefill, d0, d1),
            proxy_stack((prefill,), (d0, d1), timeouts=QUICK, silent_after_s=0.2) as stack,
        ):
            reg = stack.registry
            stream = await stack.client.open_stream(d0.url, DECODE_PATH, decode_request("a"), "a")
            d0.hang()
            # Silent before down: other nodes keep being polled; d0 is not offered work.
            await eventually(lambda: [n.url for n in reg.decode_candidates()] == [d1.url])
            assert reg.get(d0.url).status is NodeStatus.UP
            assert not reg.get(d1.url).silent(time.monotonic(), 0.2)
            # Its poll times out (control_s): down, and the stream waiting on it ends now.
            with pytest.raises(NodeLost) as lost:
                await asyncio.wait_for(stream.next_chunk(), 5.0)
            assert lost.value.cause == "node_down"
            assert reg.get(d0.url).status is NodeStatus.DOWN
            stream.close()
            d0.resume()
            await eventually(lambda: reg.get(d0.url).status is NodeStatus.UP, 5.0, "rejoin")
            assert {n.url for n in reg.decode_candidates()} == {d0.url, d1.url}

    run(body())


def test_a_poll_that_times_out_while_the_node_answers_other_calls_ends_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a partition heals, a poll on a connection in TCP's retransmission backoff can
    time out while new connections to the node work: that proves the connection stuck, not
    the node gone, so the node stays up and its streams go on; with nothing heard from the
    node while a poll waited, the node goes down as before."""

    async def body() -> None:
        decode = StubNode("decode")
        decode.tokens = list(range(8, 40))
        decode.token_delay = 0.05  # ~1.6 s of tokens: more than two poll timeouts (control_s)
        async with stubs(decode), proxy_stack((), (decode,), timeouts=QUICK) as stack:
            reg = stack.registry
            stream = await stack.client.open_stream(
                decode.url, DECODE_PATH, decode_request("a"), "a"
            )
            decode.hang_polls()
            tokens: list[int] = []
            while not tokens or tokens[-1] != 39:
                tokens += (await stream.next_chunk()).token_ids
                assert reg.get(decode.url).status is NodeStatus.UP
            stream.close()
            assert tokens == decode.tokens  # not aborted by the polls that timed out
            assert "the node answered meanwhile" in caplog.text
            # Nothing from the node any more: the next poll that times out takes it down.
            await eventually(lambda: reg.get(decode.url).status is NodeStatus.DOWN, 5.0, "down")
            decode.hang_polls(False)
            await eventually(lambda: reg.get(decode.url).status is NodeStatus.UP, 5.0, "rejoin")

    with caplog.at_level("WARNING", logger="proxy.pool.registry"):
        run(body())


def test_entries_whose_kv_is_on_a_lost_prefill_node_fail_at_once() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.max_streams = 0  # full: the entry stays queued
        async with (
            stubs(prefill, decode),
            proxy_stack((prefill,), (decode,), timeouts=QUICK, silent_after_s=0.2) as stack,
        ):
            entry = stack.queue.submit(decode_request("r1"), prefill.url)
            prefill.hang()
            with pytest.raises(NodeLost) as lost:
                await asyncio.wait_for(stack.queue.wait(entry), 5.0)
            assert lost.value.cause == "node_down"
            assert stack.metric("pdserve_interstage_exits_total", outcome="node_lost") == 1
            prefill.resume()
            await eventually(lambda: "r1" in prefill.cancels, 10.0, "the cancel")

    run(body())


def test_a_stalled_decode_stream_continues_on_the_other_decode_node() -> None:
    async def body() -> None:
        prefill, d0, d1 = StubNode("prefill"), StubNode("decode"), StubNode("decode")
        d0.tokens, d1.tokens = [8, 9, 10, 11, 12], [20, 21, 22]
        d0.token_delay = d1.token_delay = 0.05
        async with (
            stubs(prefill, d0, d1),
            proxy_stack((prefill,), (d0, d1), timeouts=QUICK, silent_after_s=5.0) as stack,
        ):
            d1.max_streams = 0  # the first attempt lands on d0
            traces = TraceStore(8)
            trace = traces.start("r1", "completions")
            backend = DisaggBackend(stack.registry, stack.client, stack.queue, traces=traces)
            req = GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=6))
            stream = backend.generate(req)
            chunks = [await anext(stream), await anext(stream)]  # prefill's 7, then d0's 8
            d0.hang()
            d1.max_streams = None
            chunks += [c async for c in stream]
            tokens = [t for c in chunks for t in c.token_ids]
            # The continuation re-prefills [1, 2, 3, 7, 8] (stubs: 7 again) and decodes on d1.
            assert tokens == [7, 8, 7, 20, 21, 22] and chunks[-1].finish_reason == "length"
            assert d1.accepted == ["r1~1"]
            rows = [row.event for row in trace.rows]
            assert "stalled" in rows and "migrating" in rows
            d0.resume()
            await eventually(lambda: "r1" in d0.disconnected or "r1" in d0.cancels, 5.0)

    run(body())


def test_stall_timeout_is_at_least_four_slowest_steps() -> None:
    async def body() -> None:
        decode = StubNode("decode")
        decode.step_time_max_s = 2.0
        async with stubs(decode), proxy_stack((), (decode,), timeouts=QUICK) as stack:
            assert stack.registry.stall_timeout(decode.url) == 8.0
            assert stack.registry.get(decode.url).role is Role.DECODE

    run(body())
