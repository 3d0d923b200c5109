"""DisaggBackend and ColocatedBackend against stub nodes: the stage order, the first token
before decode capacity, cancellation at each stage, node retry."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from common.wire.node_messages import DecodeRequest, PrefillRequest
from common.wire.sampling_params import SamplingParams
from proxy.edge import EdgeConfig, EdgeMetrics, EdgeQueue
from proxy.http.backend import BackendError, GenerationRequest, TokenChunk
from proxy.pool.budget import Claim, Limits, PreDecodeBudget, pipeline_limits
from proxy.pool.client import NodeClient
from proxy.pool.colocated import ColocatedBackend
from proxy.pool.disagg import DisaggBackend, DisaggConfig
from proxy.pool.node_state import Role
from proxy.pool.placement import DisaggMode, PlacementConfig, PlacementMetrics
from proxy.pool.registry import NodeRegistry, RegistryConfig
from proxy.trace import TraceStore
from tests.support.node_stubs import FAST, StubNode, eventually, proxy_stack, run, stubs

SAMPLING = SamplingParams(temperature=0.0, max_tokens=4)


def _request(rid: str = "req-1") -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], SAMPLING)


async def _collect(stream) -> list[TokenChunk]:  # type: ignore[no-untyped-def]
    return [chunk async for chunk in stream]


def _tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_first_token_from_prefill_then_the_decode_stream() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            backend = DisaggBackend(stack.registry, stack.client, stack.queue, DisaggConfig(7.0))
            chunks = await _collect(backend.generate(_request()))
            # The prefill's token, then the decode stream's (lines already received come as
            # one chunk).
            assert chunks[0] == TokenChunk([7], None, 0)
            assert _tokens(chunks) == [7, 8, 9, 10] and chunks[-1].finish_reason == "length"
            assert all(c.finish_reason is None for c in chunks[:-1])
            [(_, pre)], [(_, dec)] = prefill.calls, decode.calls
            assert isinstance(pre, PrefillRequest) and isinstance(dec, DecodeRequest)
            assert pre.request_id == dec.request_id == "req-1" and pre.lease_s == 7.0
            assert dec.first_token_id == 7 and dec.kv.engine_id == prefill.engine_id
            assert prefill.cancels == decode.cancels == []

    run(body())


def test_always_counts_each_attempt_as_a_prefill_pool_placement() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            registry = CollectorRegistry()
            metrics = PlacementMetrics(registry, DisaggMode.ALWAYS)
            backend = DisaggBackend(
                stack.registry, stack.client, stack.queue, placement_metrics=metrics
            )
            for rid in ("req-1", "req-2"):
                assert _tokens(await _collect(backend.generate(_request(rid)))) == [7, 8, 9, 10]
            labels = {"mode": "always", "placement": "remote", "reason": "mode"}
            assert registry.get_sample_value("pdserve_proxy_placements_total", labels) == 2
            assert len(prefill.calls) == 2 and decode.paths() == ["/internal/decode"] * 2

    run(body())


def test_the_first_token_does_not_wait_for_decode_capacity_and_close_cancels_the_queued() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.max_streams = 0  # the decode pool is full
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            backend = DisaggBackend(stack.registry, stack.client, stack.queue)
            stream = backend.generate(_request())
            assert await asyncio.wait_for(anext(stream), 1.0) == TokenChunk([7], None, 0)
            assert stack.queue.depth == 1  # queued before the first token was handed out
            waiting = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.1)
            waiting.cancel()  # the client leaves while its request waits for decode
            await asyncio.gather(waiting, return_exceptions=True)
            await stream.aclose()
            await eventually(lambda: prefill.cancels == ["req-1"], what="prefill cancel")
            assert stack.queue.depth == 0 and decode.accepted == []

    run(body())


def test_closing_during_prefill_drops_the_call_and_cancels_on_the_prefill_node() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.prefill_delay = 5.0
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            backend = DisaggBackend(stack.registry, stack.client, stack.queue)
            task = asyncio.ensure_future(_collect(backend.generate(_request())))
            await eventually(lambda: prefill.paths() == ["/internal/prefill"])
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await eventually(lambda: prefill.disconnected == ["req-1"], what="disconnect")
            await eventually(lambda: prefill.cancels == ["req-1"], what="cancel")
            assert stack.registry.nodes()[0].inflight == 0

    run(body())


def test_closing_during_decode_closes_the_stream_and_cancels_on_the_decode_node() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.tokens, decode.token_delay = list(range(8, 40)), 0.02
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            backend = DisaggBackend(stack.registry, stack.client, stack.queue)
            stream = backend.generate(_request())
            assert [await anext(stream) for _ in range(3)][-1] == TokenChunk([9])
            await stream.aclose()
            await eventually(lambda: decode.disconnected == ["req-1"], what="disconnect")
            await eventually(lambda: decode.cancels == ["req-1"], what="decode cancel")
            assert prefill.cancels == []  # a decode token came: the KV had landed

    run(body())


def test_a_request_finished_at_its_first_token_never_reaches_decode() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.finish_at_first = "stop"
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            backend = DisaggBackend(stack.registry, stack.client, stack.queue)
            assert await _collect(backend.generate(_request())) == [TokenChunk([7], "stop", 0)]
            assert decode.calls == [] and stack.queue.depth == 0

    run(body())


def test_an_unreachable_prefill_node_is_skipped_and_marked_down() -> None:
    async def body() -> None:
        dead, live, decode = StubNode("prefill"), StubNode("prefill"), StubNode("decode")
        live.queued_prefill_tokens = 1000  # the dead one looks less loaded
        async with stubs(dead, live, decode):
            async with proxy_stack((dead, live), (decode,), poll_interval_s=60) as stack:
                await dead.stop()
                backend = DisaggBackend(stack.registry, stack.client, stack.queue)
                chunks = await _collect(backend.generate(_request()))
                assert _tokens(chunks) == [7, 8, 9, 10]
                assert [n.healthy for n in stack.registry.nodes()] == [False, True, True]

    run(body())


def test_a_refusing_prefill_node_is_a_client_error_without_retry() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            prefill.refuse_prefill = True
            backend = DisaggBackend(stack.registry, stack.client, stack.queue)
            with pytest.raises(BackendError) as err:
                await _collect(backend.generate(_request()))
            assert err.value.status == 400 and err.value.message == "prompt too long"
            await asyncio.sleep(0.05)
            assert prefill.paths() == ["/internal/prefill"] and prefill.cancels == []

    run(body())


def test_without_a_healthy_decode_node_nothing_is_prefilled() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.health_status = 503
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            backend = DisaggBackend(stack.registry, stack.client, stack.queue)
            with pytest.raises(BackendError) as err:
                await _collect(backend.generate(_request()))
            assert err.value.status == 503 and "decode" in err.value.message
            assert prefill.calls == []

    run(body())


def test_colocated_backend_streams_from_a_both_node_and_cancels_on_close() -> None:
    async def body() -> None:
        node = StubNode("both")
        node.tokens, node.token_delay = list(range(8, 40)), 0.02
        client = NodeClient(FAST)
        registry = NodeRegistry(client, RegistryConfig(0.05, frozenset({"both"})))  # type: ignore[arg-type]
        async with stubs(node):
            await client.start()
            try:
                registry.add(node.url, "both")
                await registry.start()
                backend = ColocatedBackend(registry, client)
                stream = backend.generate(_request())
                assert [(await anext(stream)).token_ids for _ in range(2)] == [[7], [8]]
                await stream.aclose()
                await eventually(lambda: node.cancels == ["req-1"] and node.disconnected)
            finally:
                await registry.stop()
                await client.close()

    run(body())


def test_a_request_holds_the_pre_decode_budget_until_a_decode_node_takes_it() -> None:
    """Held from the edge's admission through prefill and the inter-stage queue; released
    when the decode stream is accepted, not when the request ends."""

    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        decode.max_streams, decode.hold_streams = 0, True
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            budget = PreDecodeBudget(pipeline_limits(stack.registry, backlog_s=2.0))
            released: list[int] = []
            budget.add_listener(lambda: released.append(budget.requests))
            backend = DisaggBackend(stack.registry, stack.client, stack.queue, budget=budget)
            budget.hold("req-1", Claim(3, 3))  # as the edge does when it admits the request
            stream = backend.generate(_request())
            assert await asyncio.wait_for(anext(stream), 1.0) == TokenChunk([7], None, 0)
            waiting = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.1)
            assert stack.queue.depth == 1 and budget.requests == 1  # prefilled, queued: held
            assert budget.prefill_tokens == 0 and released == [1]  # no longer prefill work
            decode.max_streams = None
            stack.queue.notify_capacity()
            await eventually(lambda: decode.accepted == ["req-1"], what="decode accepted")
            await eventually(lambda: released == [1, 0], what="released on acceptance")
            decode.release("req-1")
            assert (await waiting).token_ids[0] == 8
            await stream.aclose()
            assert released == [1, 0]  # the end released nothing more
            # the stub's /state: 8 sequences, 100 blocks of 16; no prefill rate measured
            assert budget.limits() == Limits(8, 100 * 16, prefill_tokens=None, prefill_nodes=1)
            prefill.prefill_tokens_per_s = 300.0
            await stack.registry.poll_all()
            assert budget.limits().prefill_tokens == 600  # 2 s of the measured rate

    run(body())


def _auto_backend(stack, budget: PreDecodeBudget | None = None):  # type: ignore[no-untyped-def]
    traces = TraceStore(16)
    backend = DisaggBackend(
        stack.registry, stack.client, stack.queue, traces=traces, budget=budget,
        placement=PlacementConfig(DisaggMode.AUTO, local_max_tokens=64),
    )  # fmt: skip
    return backend, traces


def test_auto_prefills_a_short_prompt_on_the_decode_node_when_the_prefill_queue_is_long() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.queued_prefill_tokens, prefill.prefill_tokens_per_s = 4000, 400.0  # 10 s queued
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            budget = PreDecodeBudget(lambda: Limits(8, None))
            backend, traces = _auto_backend(stack, budget)
            traces.start("req-1", "chat")
            chunks = await _collect(backend.generate(_request()))
            # The decode node prefilled it: its stream starts with the first token; nothing
            # went to the prefill node, and the request left the pre-decode budget.
            assert _tokens(chunks) == [7, 8, 9, 10] and chunks[-1].finish_reason == "length"
            assert prefill.calls == [] and decode.paths() == ["/internal/generate"]
            assert budget.requests == 0 and stack.queue.depth == 0
            trace = traces.get("req-1")
            assert trace is not None
            (placed,) = [r for r in trace.rows if r.event == "placed"]
            # The decode node has measured nothing: it borrows the prefill pool's rate.
            assert placed.detail.startswith("auto: local (earlier)")
            assert f"decode {decode.url} est 8 ms" in placed.detail
            assert f"prefill {prefill.url} est 10008 ms" in placed.detail

    run(body())


def test_the_tpot_objective_times_each_decode_stream_and_spares_a_node_without_slack() -> None:
    """`auto` with the TPOT objective: the streams relayed from a decode node are timed
    while they last (a local one from its first chunk, a remote one from its first token);
    a node whose streams have no slack left gets no local prefill, however much earlier."""

    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.queued_prefill_tokens, prefill.prefill_tokens_per_s = 4000, 400.0  # 10 s queued
        decode.token_delay = 0.05
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            traces = TraceStore(16)
            placement = PlacementConfig(DisaggMode.AUTO, local_max_tokens=64, tpot_slo_s=0.1)
            backend = DisaggBackend(
                stack.registry, stack.client, stack.queue, traces=traces, placement=placement
            )
            clocks = backend.clocks
            first = asyncio.ensure_future(_collect(backend.generate(_request("req-1"))))
            await eventually(lambda: clocks.step_s(decode.url) is not None, what="timed")
            assert clocks.streams(decode.url) == 1 and decode.paths() == ["/internal/generate"]
            assert _tokens(await first) == [7, 8, 9, 10]
            assert clocks.streams(decode.url) == 0  # stopped with its stream
            # A stream that has used up its objective: 3 tokens, the first 10 s ago.
            late = clocks.start(decode.url, "late", 3, time.monotonic() - 10.0)
            clocks.tokens(decode.url, late, 1)
            traces.start("req-2", "chat")
            second = asyncio.ensure_future(_collect(backend.generate(_request("req-2"))))
            await eventually(lambda: clocks.streams(decode.url) == 2, what="remote stream timed")
            assert _tokens(await second) == [7, 8, 9, 10]
            assert [p for p, _ in prefill.calls] == ["/internal/prefill"]
            assert clocks.streams(decode.url) == 1  # the made-up one
            trace = traces.get("req-2")
            assert trace is not None
            (placed,) = [r for r in trace.rows if r.event == "placed"]
            assert placed.detail.startswith("auto: prefill pool (misses_tpot_slo)")

    run(body())


def test_a_ttft_objective_counts_from_the_requests_arrival_and_the_prompts_ahead_of_it() -> None:
    """A decode node with 32 streams: a 48-token local prefill would cost them 3.84 s in all,
    more than the 3 s it saves a prompt behind 1,200 queued tokens, so `auto` keeps it on the
    prefill pool (3.12 s, inside a 5 s objective), unless the request has waited, or would
    wait at the edge, long enough to miss the objective there."""

    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.queued_prefill_tokens, prefill.prefill_tokens_per_s = 1200, 400.0
        decode.max_num_seqs, decode.free_blocks = 64, 1000
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            await stack.registry.poll_all()
            traces = TraceStore(16)
            placement = PlacementConfig(DisaggMode.AUTO, local_max_tokens=64, ttft_slo_s=5.0)
            backend = DisaggBackend(
                stack.registry, stack.client, stack.queue, traces=traces, placement=placement
            )
            (node,) = stack.registry.healthy(Role.DECODE)
            for _ in range(32):
                node.sent(0, kv_tokens=64)
            prompt = [1] * 48
            assert not backend.prefills_locally(prompt)
            assert backend.prefills_locally(prompt, waited_s=2.0)  # 5.12 s from the pool
            assert backend.prefills_locally(prompt, ahead_tokens=800)  # 2 s more at the edge
            assert not backend.prefills_locally(prompt, waited_s=4.95)  # late either way
            late = replace(_request(), prompt_token_ids=prompt, arrived_s=time.monotonic() - 2)
            traces.start("req-1", "chat")
            chunks = await _collect(backend.generate(late))
            assert _tokens(chunks) == [7, 8, 9, 10] and prefill.calls == []
            trace = traces.get("req-1")
            assert trace is not None
            (placed,) = [r.detail for r in trace.rows if r.event == "placed"]
            assert placed.startswith("auto: local (meets_ttft_slo)")
            assert "cost to its streams 3840 ms" in placed

    run(body())


def test_the_edge_lets_a_prompt_auto_prefills_locally_past_the_prefill_horizon() -> None:
    """A long prompt computing on the only prefill node fills the backlog horizon. A short
    prompt that `auto` sends to the decode node enters the pipeline at once and is prefilled
    there; under `always`, or when too long to prefill locally, it waits at the edge."""

    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.prefill_tokens_per_s = 100.0  # horizon: 2 s of it, 200 tokens
        prefill.queued_prefill_tokens = 1000  # the long prompt: 10 s of work queued there
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            await stack.registry.poll_all()
            budget = PreDecodeBudget(pipeline_limits(stack.registry, backlog_s=2.0))
            backend, traces = _auto_backend(stack, budget)
            budget.local = backend.prefills_locally  # as the proxy wires it
            edge = EdgeQueue(EdgeConfig(), EdgeMetrics(CollectorRegistry()), budget)
            budget.hold("long", budget.claim([5] * 1000))  # admitted, prefilling
            short, too_long = budget.claim([1, 2, 3]), budget.claim([1] * 100)
            assert budget.fits(short) and not budget.fits(too_long)  # local_max_tokens 64
            traces.start("req-1", "chat")
            async with edge.slot("req-1", [1, 2, 3]):
                chunks = await _collect(backend.generate(_request()))
            assert _tokens(chunks) == [7, 8, 9, 10]
            assert prefill.calls == [] and decode.paths() == ["/internal/generate"]
            trace = traces.get("req-1")
            assert trace is not None
            # The edge's check left no trace of its own: one placement, the backend's.
            assert [r.detail[:20] for r in trace.rows if r.event == "placed"] == [
                "auto: local (earlier"
            ]
            assert budget.requests == 1  # the long one
            backend.placement = PlacementConfig(DisaggMode.ALWAYS)
            assert not budget.fits(short)

    run(body())


def _streamed(stack, **config: float) -> DisaggBackend:  # type: ignore[no-untyped-def]
    return DisaggBackend(
        stack.registry, stack.client, stack.queue, DisaggConfig(kv_streaming=True, **config)
    )


def test_streamed_kv_engages_the_decode_node_before_the_first_token() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.prefill_delay = 0.3  # the prompt computes...
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            task = asyncio.ensure_future(_collect(_streamed(stack).generate(_request())))
            # ...while the decode node already has the request, without a first token.
            await eventually(lambda: decode.accepted == ["req-1"], what="decode dispatched")
            assert not task.done()
            [(path, _)], [(_, dec)] = prefill.calls, decode.calls
            assert path == "/internal/prefill_streamed" and isinstance(dec, DecodeRequest)
            assert dec.first_token_id is None and dec.kv.engine_id == prefill.engine_id
            chunks = await task
            assert chunks[0] == TokenChunk([7], None, 0)
            assert _tokens(chunks) == [7, 8, 9, 10] and chunks[-1].finish_reason == "length"
            assert prefill.cancels == decode.cancels == []

    run(body())


def test_auto_uses_the_prefill_pool_when_it_is_idle_and_falls_back_to_local_without_it() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.prefill_tokens_per_s = 400.0
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            backend, traces = _auto_backend(stack)
            assert _tokens(await _collect(backend.generate(_request()))) == [7, 8, 9, 10]
            assert prefill.paths() == ["/internal/prefill"]
            assert decode.paths() == ["/internal/decode"]
            prefill.health_status = 503  # the prefill pool is gone: decode nodes prefill
            await eventually(lambda: not stack.registry.healthy(Role.PREFILL), what="down")
            traces.start("req-2", "chat")
            assert _tokens(await _collect(backend.generate(_request("req-2")))) == [7, 8, 9, 10]
            assert decode.paths()[-1] == "/internal/generate"
            trace = traces.get("req-2")
            assert trace is not None
            assert any(r.detail.startswith("auto: local (no_prefill_node)") for r in trace.rows)

    run(body())


def test_a_prefill_node_at_another_epoch_did_not_take_the_request_and_another_does() -> None:
    async def body() -> None:
        moved, other, decode = StubNode("prefill"), StubNode("prefill"), StubNode("decode")
        other.queued_prefill_tokens = 100_000  # routing tries `moved` first
        async with (
            stubs(moved, other, decode),
            proxy_stack((moved, other), (decode,), poll_interval_s=30) as stack,
        ):
            moved.epoch = 1  # it changed role twice since the proxy's last poll
            backend = DisaggBackend(stack.registry, stack.client, stack.queue)
            chunks = await _collect(backend.generate(_request()))
            assert _tokens(chunks) == [7, 8, 9, 10]
            [(_, refused)], [(_, taken)] = moved.calls, other.calls
            assert refused.epoch == taken.epoch == 0  # the epoch the proxy saw, stamped
            assert moved.cancels == []  # 409: it holds nothing, nothing to cancel
            [(_, dec)] = decode.calls
            assert dec.epoch == 0 and dec.kv.engine_id == other.engine_id

    run(body())


def test_streamed_kv_finished_at_the_first_token_cancels_the_engaged_decode_node() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.prefill_delay, prefill.finish_at_first = 0.3, "stop"
        decode.hold_streams = True  # the decode side waits for KV that will never come
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            chunks = await _collect(_streamed(stack).generate(_request()))
            assert chunks == [TokenChunk([7], "stop", 0)]
            await eventually(lambda: decode.cancels == ["req-1"], what="decode cancel")
            await eventually(lambda: "req-1" in decode.disconnected, what="stream dropped")

    run(body())


def test_closing_a_streamed_prefill_cancels_on_both_nodes() -> None:
    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        prefill.prefill_delay = 5.0
        decode.hold_streams = True
        async with stubs(prefill, decode), proxy_stack((prefill,), (decode,)) as stack:
            task = asyncio.ensure_future(_collect(_streamed(stack).generate(_request())))
            await eventually(lambda: decode.accepted == ["req-1"], what="decode dispatched")
            task.cancel()  # the client leaves while the prompt computes
            await asyncio.gather(task, return_exceptions=True)
            await eventually(lambda: "req-1" in prefill.disconnected, what="prefill call dropped")
            await eventually(lambda: decode.cancels == ["req-1"], what="decode cancel")
            await eventually(lambda: "req-1" in prefill.cancels, what="prefill cancel")
            assert stack.queue.depth == 0

    run(body())


@pytest.mark.parametrize(
    ("line", "status", "says"),
    [
        (b'{"type": "token_delta", "request_id": "req-1", "token_ids": [], '
         b'"error": "cancelled by the client", "error_code": "cancelled"}',
         400, "cancelled by the client"),
        (b'{"type": "token_delta", "request_id": "req-1", "token_ids": [], '
         b'"error": "engine died", "error_code": "engine_error"}',
         502, "failed: engine died"),
        (b'{"type": "prefill_result", "request_id": "req-1"}', 502, "sent a bad line"),
        (b"not json at all", 502, "sent a bad line"),
        (b'{"type": "prefill_result", "request_id": "other", "first_token_id": 7, '
         b'"finish_reason": "stop", "kv": null}',
         502, "answered another request"),
    ],
)  # fmt: skip
def test_a_streamed_prefill_result_line_that_is_not_a_result_says_why(
    line: bytes, status: int, says: str
) -> None:
    async def body() -> None:
        prefill = StubNode("prefill")
        prefill.streamed_result_line = line + b"\n"
        async with stubs(prefill), proxy_stack((prefill,), ()) as stack:
            req = PrefillRequest(
                request_id="req-1", prompt_token_ids=[1, 2, 3], sampling=SAMPLING, lease_s=5.0
            )
            stream = await stack.client.prefill_streamed(prefill.url, req)
            try:
                assert (await stream.accepted()).request_id == "req-1"
                with pytest.raises(BackendError) as caught:
                    await stream.result()
            finally:
                stream.close()
            assert caught.value.status == status and says in caught.value.message

    run(body())
