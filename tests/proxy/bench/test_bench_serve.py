"""`pdserve bench-serve` without a cluster: the statistics, the stream timing rules, the load
loop's bounds, failure counting against a server that misbehaves in every way and against a
port where nothing listens. (tests/e2e/test_bench_serve.py runs it against real processes.)"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.bench.client import RequestResult, StreamError, StreamTimer, parse_sse_line
from proxy.bench.load import LoadConfig, Progress, arrival_offsets, run_load
from proxy.bench.main import bench, build_parser, config_from_args, json_paths, main
from proxy.bench.stats import Slo, distribution, max_concurrent, summarize
from proxy.bench.workload import (
    ConversationWorkload,
    JsonlWorkload,
    RandomWorkload,
    WorkItem,
    request_body,
)


def _ok(ttft: float, e2el: float, tokens: int, start: float = 0.0, **kw: Any) -> RequestResult:
    return RequestResult(
        ok=True,
        start_s=start,
        e2el_s=e2el,
        requested_output_tokens=tokens,
        ttft_s=ttft,
        output_tokens=tokens,
        usage_reported=True,
        **kw,
    )


# -- statistics ------------------------------------------------------------------------------


def test_distribution_interpolates_percentiles_linearly() -> None:
    d = distribution([float(x) for x in range(100, 0, -1)])  # 1..100, unsorted
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)  # halfway between the 50th and 51st values
    assert d["p90"] == pytest.approx(90.1)  # 1 + 0.90 * 99
    assert d["p99"] == pytest.approx(99.01)
    assert (d["min"], d["max"]) == (1.0, 100.0)
    assert distribution([7.0])["p99"] == 7.0
    assert set(distribution([]).values()) == {None}


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert _ok(0.1, 1.1, 11).tpot_s == pytest.approx(0.1)
    assert _ok(0.1, 0.1, 1).tpot_s is None  # one token: no TPOT
    failed = RequestResult(ok=False, start_s=0, e2el_s=1.0, requested_output_tokens=4)
    assert failed.tpot_s is None


def test_summary_counts_throughput_and_goodput_against_each_slo() -> None:
    results = [
        _ok(0.05, 0.50, 10, itl_s=[0.05] * 9),  # meets all: ttft 50 ms, tpot 50 ms
        _ok(0.30, 0.75, 10, itl_s=[0.05] * 9),  # ttft 300 ms: misses the TTFT SLO
        _ok(0.05, 1.85, 10, itl_s=[0.2] * 9),  # tpot 200 ms: misses the TPOT SLO
        _ok(0.05, 0.05, 1),  # one token, no TPOT: meets the TPOT SLO
        RequestResult(
            ok=False, start_s=0, e2el_s=0.1, requested_output_tokens=10, error="HTTP 503"
        ),
    ]
    results[1].usage_reported = False
    s = summarize(results, duration_s=2.0, slo=Slo(ttft_ms=100, tpot_ms=100))
    assert (s["sent"], s["completed"], s["failed"], s["rejected"]) == (5, 4, 1, 1)
    assert s["rejected_throughput"] == pytest.approx(0.5)  # the 503: refused, not broken
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["total_output_tokens"] == 31
    assert s["output_token_throughput"] == pytest.approx(15.5)
    assert s["goodput"] == pytest.approx(1.0)  # 2 good requests in 2 s
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["output_tokens_source"] == "mixed"
    assert s["errors"] == {"total": 1, "by_kind": {"HTTP 503": 1}, "examples": {"HTTP 503": ""}}
    assert s["ttft_ms"]["max"] == pytest.approx(300.0)
    assert s["tpot_ms"]["max"] == pytest.approx(200.0)
    assert s["itl_ms"]["mean"] == pytest.approx((0.05 * 18 + 0.2 * 9) / 27 * 1e3)
    assert len({s["ttft_ms"]["p50"], s["e2el_ms"]["p50"]}) == 2

    e2e_only = summarize(results, 2.0, Slo(e2el_ms=800))
    assert e2e_only["goodput"] == pytest.approx(1.5)  # 0.50, 0.75 and 0.05 s
    assert summarize(results, 2.0, Slo())["goodput"] is None


def test_peak_concurrency_from_send_and_end_times() -> None:
    results = [_ok(0.1, 1.0, 2, start=0.0), _ok(0.1, 1.0, 2, start=0.5), _ok(0.1, 1.0, 2, 1.0)]
    assert max_concurrent(results) == 2  # the first ends as the third starts
    assert max_concurrent([]) == 0


def test_bad_slo_is_refused() -> None:
    with pytest.raises(ValueError, match="slo-ttft-ms"):
        Slo(ttft_ms=0)


# -- stream timing ---------------------------------------------------------------------------


def _chat_chunk(content: str | None, role: bool = False, usage: Any = None) -> str:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return json.dumps({"choices": [{"index": 0, "delta": delta}], "usage": usage})


def test_stream_timer_times_text_chunks_and_reads_usage() -> None:
    timer = StreamTimer()
    timer.feed(_chat_chunk("", role=True), 0.010)  # the role chunk carries no text
    timer.feed(_chat_chunk("Hel"), 0.100)
    timer.feed(_chat_chunk("lo"), 0.130)
    timer.feed(_chat_chunk(None), 0.140)  # the finish chunk: no text
    timer.feed(_chat_chunk(" you"), 0.200)
    timer.feed(
        json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}), 0.21
    )
    timer.feed("[DONE]", 0.220)
    assert timer.first_text_s == 0.100
    assert timer.itl_s == pytest.approx([0.030, 0.070])
    assert timer.text_chunks == 3
    assert timer.usage == {"prompt_tokens": 7, "completion_tokens": 4}
    assert timer.done_s == 0.220

    completion = StreamTimer()
    completion.feed(json.dumps({"choices": [{"text": "a", "finish_reason": None}]}), 0.5)
    assert completion.first_text_s == 0.5


def test_stream_timer_raises_on_error_events_and_garbage() -> None:
    error = {"error": {"message": "aborted", "type": "server_error", "code": "aborted"}}
    with pytest.raises(StreamError, match="aborted"):
        StreamTimer().feed(json.dumps(error), 0.1)
    with pytest.raises(StreamError, match="bad event"):
        StreamTimer().feed("{not json", 0.1)


def test_sse_lines() -> None:
    assert parse_sse_line(b'data: {"a": 1}\n') == '{"a": 1}'
    assert parse_sse_line(b"data:[DONE]\r\n") == "[DONE]"
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line(b": keep-alive\n") is None
    assert parse_sse_line(b"event: x\n") is None


# -- workload --------------------------------------------------------------------------------


def test_random_workload_lengths_stay_in_range_and_repeat_with_the_seed() -> None:
    w = RandomWorkload(input_len=100, output_len=20, range_ratio=0.5)
    items = list(itertools.islice(w.items(seed=3), 200))
    assert items == list(itertools.islice(w.items(seed=3), 200))
    assert items != list(itertools.islice(w.items(seed=4), 200))
    assert {len(i.prompt.split()) for i in items} <= set(range(50, 151))
    outs = {i.max_tokens for i in items}
    assert outs <= set(range(10, 31)) and len(outs) > 10
    fixed = list(itertools.islice(RandomWorkload(8, 3).items(seed=0), 5))
    assert all(len(i.prompt.split()) == 8 and i.max_tokens == 3 for i in fixed)
    with pytest.raises(ValueError):
        RandomWorkload(8, 3, range_ratio=1.0)


def test_random_prompts_cut_to_exact_token_counts(tiny_tokenizer: Any) -> None:
    items = itertools.islice(RandomWorkload(40, 4).items(5, tiny_tokenizer), 20)
    counts = [len(tiny_tokenizer.encode(item.prompt)) for item in items]
    assert all(abs(n - 40) <= 1 for n in counts), counts  # re-encoding drift at the cut only


def test_jsonl_dataset_lines_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "d.jsonl"
    lines = [
        {"prompt": "hi", "max_tokens": 3},
        {"messages": [{"role": "user", "content": "yo"}]},
    ]
    good.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = JsonlWorkload.load(good, default_max_tokens=9)
    assert w.items_in_file == (
        WorkItem(max_tokens=3, prompt="hi"),
        WorkItem(max_tokens=9, messages=({"role": "user", "content": "yo"},)),
    )
    assert len(list(itertools.islice(w.items(seed=0), 5))) == 5  # reused in turn
    for bad in ('{"prompt": ""}', '{"prompt": "x", "max_tokens": 0}', "[1]", "{x", "{}"):
        path = tmp_path / "bad.jsonl"
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="bad.jsonl:1"):
            JsonlWorkload.load(path, 4)
    args = build_parser().parse_args(["--dataset", str(good), "--model", "m"])
    with pytest.raises(ValueError, match="--endpoint chat"):
        config_from_args(args)


def test_request_body_asks_for_exactly_max_tokens() -> None:
    item = WorkItem(max_tokens=5, prompt="p")
    body = request_body(item, "completions", "m", 0.0, True, {"top_k": 1})
    assert body == {
        "model": "m",
        "max_tokens": 5,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "prompt": "p",
        "top_k": 1,
    }
    chat = request_body(item, "chat", "m", 0.0, False, {})
    assert chat["messages"] == [{"role": "user", "content": "p"}] and "ignore_eos" not in chat


# -- load loop -------------------------------------------------------------------------------


def test_arrival_schedules() -> None:
    fixed = list(itertools.islice(arrival_offsets(4.0, "fixed", random.Random(0)), 5))
    assert fixed == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    burst = list(itertools.islice(arrival_offsets(math.inf, "poisson", random.Random(0)), 5))
    assert burst == [0.0] * 5
    poisson = list(itertools.islice(arrival_offsets(10.0, "poisson", random.Random(1)), 4001))
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert len(set(gaps)) == len(gaps)  # not a fixed schedule


def _quiet(cfg: LoadConfig) -> Progress:
    return Progress(cfg, "test", enabled=False)


def test_load_loop_caps_concurrency_and_sends_num_requests() -> None:
    cfg = LoadConfig(rate=math.inf, max_concurrency=3, num_requests=10)
    in_flight = peak = 0

    async def send(item: int, run_start: float) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return _ok(0.01, 0.02, 2)

    out = asyncio.run(run_load(cfg, iter(range(100)), send, 0, _quiet(cfg)))
    assert out.sent == 10 and all(r.ok for r in out.results)
    assert peak == 3


def test_load_loop_stops_at_the_deadline_and_cancels_what_outlives_the_drain() -> None:
    cfg = LoadConfig(rate=20.0, arrival="fixed", duration_s=0.475, drain_timeout_s=0.2)
    sent: list[int] = []

    async def send(item: int, run_start: float) -> RequestResult:
        sent.append(item)
        await asyncio.sleep(10.0 if item % 2 else 0.01)  # odd requests hang
        return _ok(0.005, 0.01, 2)

    out = asyncio.run(asyncio.wait_for(run_load(cfg, itertools.count(), send, 0, _quiet(cfg)), 5))
    assert out.sent == len(sent) == 10  # sends at 0, 0.05, ..., 0.45 s
    failed = [r for r in out.results if not r.ok]
    assert len(failed) == 5 and {r.error for r in failed} == {"drain timeout"}
    assert 0.475 <= out.duration_s < 1.5
    summary = summarize(out.results, out.duration_s, Slo())
    assert summary["completed"] + summary["failed"] == summary["sent"] == 10


def test_a_send_that_raises_is_a_failed_request_not_a_crash() -> None:
    cfg = LoadConfig(num_requests=3)

    async def send(item: int, run_start: float) -> RequestResult:
        if item == 1:
            raise RuntimeError("bug")
        return _ok(0.01, 0.02, 2)

    out = asyncio.run(run_load(cfg, iter(range(3)), send, 0, _quiet(cfg)))
    assert [r.ok for r in out.results] == [True, False, True]
    assert out.results[1].error == "client bug: RuntimeError"


def test_load_config_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="--num-requests or --duration-s"):
        LoadConfig()
    with pytest.raises(ValueError, match="--max-concurrency"):
        LoadConfig(duration_s=1.0)  # rate inf, unbounded by count: would flood
    LoadConfig(duration_s=1.0, max_concurrency=2)
    with pytest.raises(ValueError):
        LoadConfig(rate=0.0, num_requests=1)


def test_sweep_writes_one_json_per_rate(tmp_path: Path) -> None:
    assert json_paths(tmp_path / "r.json", (2.0,)) == [tmp_path / "r.json"]
    assert json_paths(tmp_path / "r.json", (1.0, 2.5, math.inf)) == [
        tmp_path / "r-rate1.json",
        tmp_path / "r-rate2.5.json",
        tmp_path / "r-rateinf.json",
    ]


# -- failures over HTTP ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nothing_listening_counts_every_request_failed(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    out = tmp_path / "r.json"
    argv = ["--base-url", url, "--model", "m", "--num-requests", "7", "--max-concurrency", "3"]
    argv += ["--request-timeout-s", "5", "--json", str(out), "--no-progress"]
    assert main(argv) == 1  # ran, but nothing completed
    doc = json.loads(out.read_text())
    assert (doc["sent"], doc["completed"], doc["failed"]) == (7, 0, 7)
    assert doc["errors"]["by_kind"] == {"connect error": 7}
    assert doc["request_throughput"] == 0.0 and doc["ttft_ms"]["p50"] is None
    # Without --model the model list is needed first: a clear error, status 2.
    assert main(["--base-url", url, "--num-requests", "1", "--no-progress"]) == 2


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


async def _misbehaving_server(bodies: list[dict[str, Any]]) -> web.AppRunner:
    """An OpenAI-ish server whose answer depends on the prompt."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        prompt = body["prompt"]
        if prompt == "busy":
            error = {"error": {"message": "overloaded", "type": "overloaded_error", "code": None}}
            return web.json_response(error, status=503)
        if prompt == "slow":
            await asyncio.sleep(30)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b", "c")[: 2 if prompt == "nousage" else 3]:
            await resp.write(_sse({"choices": [{"index": 0, "text": text}]}))
            await asyncio.sleep(0.01)
            if prompt == "midway":
                await resp.write(_sse({"error": {"message": "node died", "code": "aborted"}}))
                break
            if prompt == "cut":
                return resp
        if prompt == "ok":
            usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
            await resp.write(_sse({"choices": [], "usage": usage}))
        await resp.write(_sse("[DONE]"))
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def test_every_kind_of_failure_is_counted_once(tmp_path: Path) -> None:
    prompts = ["ok", "nousage", "busy", "midway", "cut", "slow"]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "max_tokens": 3}) + "\n" for p in prompts))
    bodies: list[dict[str, Any]] = []

    async def body() -> list[dict[str, Any]]:
        runner = await _misbehaving_server(bodies)
        try:
            host, port = runner.addresses[0][:2]
            argv = ["--base-url", f"http://{host}:{port}/v1", "--dataset", str(dataset)]
            argv += ["--num-requests", "6", "--request-timeout-s", "1", "--drain-timeout-s", "5"]
            argv += ["--slo-ttft-ms", "10000", "--no-progress"]
            return await bench(config_from_args(build_parser().parse_args(argv)))
        finally:
            await runner.cleanup()

    (doc,) = asyncio.run(asyncio.wait_for(body(), 20))
    assert (doc["sent"], doc["completed"], doc["failed"]) == (6, 2, 4)
    assert doc["errors"]["by_kind"] == {
        "HTTP 503": 1,
        "stream error": 1,
        "truncated stream": 1,
        "timeout": 1,
    }
    assert "overloaded" in doc["errors"]["examples"]["HTTP 503"]
    assert doc["config"]["model"] == "fake-model"  # from /v1/models
    assert doc["total_output_tokens"] == 3 + 2  # usage for "ok", one per chunk for "nousage"
    assert doc["output_tokens_source"] == "mixed" and doc["short_outputs"] == 1
    assert doc["goodput"] == pytest.approx(doc["request_throughput"])
    # The server sleeps 10 ms after each chunk: "nousage" takes >= 20 ms, "ok" >= 30 ms.
    assert doc["e2el_ms"]["min"] >= 20.0 and doc["e2el_ms"]["max"] >= 30.0
    assert 0 < doc["ttft_ms"]["max"] <= doc["e2el_ms"]["max"] and doc["itl_ms"]["min"] >= 0
    assert all(b["model"] == "fake-model" and b["ignore_eos"] is True for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)


def test_save_detailed_keeps_every_request_and_every_gap(tmp_path: Path) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": p, "max_tokens": 3}) + "\n" for p in ["ok", "busy"])
    )
    out = tmp_path / "r.json"

    async def body() -> None:
        runner = await _misbehaving_server([])
        try:
            host, port = runner.addresses[0][:2]
            argv = ["--base-url", f"http://{host}:{port}/v1", "--dataset", str(dataset)]
            argv += ["--num-requests", "2", "--rate", "50", "--json", str(out), "--no-progress"]
            await bench(config_from_args(build_parser().parse_args([*argv, "--save-detailed"])))
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(body(), 20))
    doc = json.loads(out.read_text())
    ok, busy = sorted(doc["requests"], key=lambda r: not r["ok"])
    assert (ok["ok"], ok["output_tokens"], ok["prompt_tokens"], ok["error"]) == (True, 3, 1, None)
    assert len(ok["itl_ms"]) == 2 and all(gap >= 10.0 for gap in ok["itl_ms"])  # 10 ms sleeps
    assert 0 < ok["ttft_ms"] <= ok["e2el_ms"]
    assert (busy["ok"], busy["error"], busy["itl_ms"], busy["ttft_ms"]) == (
        False,
        "HTTP 503",
        [],
        None,
    )
    assert doc["itl_ms"]["max"] == pytest.approx(max(ok["itl_ms"]), abs=1e-3)
    assert [r["start_ms"] for r in doc["requests"]] == sorted(
        r["start_ms"] for r in doc["requests"]
    )


def test_random_prompts_can_share_a_prefix() -> None:
    items = list(itertools.islice(RandomWorkload(8, 3, prefix_len=30).items(seed=1), 20))
    words = [i.prompt.split() for i in items]
    assert all(len(w) == 38 for w in words)
    assert len({tuple(w[:30]) for w in words}) == 1  # one prefix for the whole run
    assert len({tuple(w[30:]) for w in words}) == 20
    other = next(RandomWorkload(8, 3, prefix_len=30).items(seed=2))
    assert other.prompt.split()[:30] != words[0][:30]  # another seed, another prefix
    with pytest.raises(ValueError):
        RandomWorkload(8, 3, prefix_len=-1)


def test_random_prompts_can_take_one_of_several_prefixes_with_zipf_popularity() -> None:
    w = RandomWorkload(8, 3, prefix_len=30, num_prefixes=4, prefix_zipf=1.5)
    items = list(itertools.islice(w.items(seed=1), 400))
    counts = Counter(tuple(i.prompt.split()[:30]) for i in items)
    assert len(counts) == 4
    ranked = [n for _, n in counts.most_common()]
    assert ranked[0] > 2 * ranked[-1]  # weights 1, 0.35, 0.19, 0.125
    # The first prefix and the own parts are those of the single-prefix workload.
    single = list(itertools.islice(RandomWorkload(8, 3, prefix_len=30).items(seed=1), 400))
    assert [i.prompt.split()[30:] for i in items] == [i.prompt.split()[30:] for i in single]
    assert tuple(single[0].prompt.split()[:30]) in counts
    with pytest.raises(ValueError):
        RandomWorkload(8, 3, num_prefixes=0)


def test_a_prefix_seed_keeps_the_prefixes_and_changes_the_rest() -> None:
    def head(w: RandomWorkload, seed: int) -> tuple[set[str], list[str]]:
        items = list(itertools.islice(w.items(seed=seed), 200))
        return {" ".join(i.prompt.split()[:30]) for i in items}, [i.prompt for i in items]

    measured = RandomWorkload(8, 3, prefix_len=30, num_prefixes=3)
    warm = RandomWorkload(8, 3, prefix_len=30, num_prefixes=3, prefix_seed=1)
    prefixes, prompts = head(measured, 1)
    warm_prefixes, warm_prompts = head(warm, 2)
    assert warm_prefixes == prefixes and len(prefixes) == 3
    assert not set(warm_prompts) & set(prompts)  # the same tenants, none of the same prompts
    assert head(RandomWorkload(8, 3, prefix_len=30, num_prefixes=3), 2)[0].isdisjoint(prefixes)


def test_a_conversation_carries_its_history_and_answers_forward() -> None:
    w = ConversationWorkload(system_len=20, user_len=5, output_len=3, turns=3)
    talks = list(itertools.islice(w.sessions(seed=2), 4))
    assert talks == list(itertools.islice(w.sessions(seed=2), 4))  # the seed fixes them
    assert len({t.system for t in talks}) == 1 and len(talks[0].system.split()) == 20
    assert len({t.users for t in talks}) == 4 and all(len(t.users) == 3 for t in talks)
    third = talks[0].turn(2, ["first answer", "second answer"])
    roles = [m["role"] for m in third.messages or ()]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third.messages or ()][2::2] == ["first answer", "second answer"]
    with pytest.raises(ValueError):
        talks[0].turn(1, [])  # turn 1 needs the answer to turn 0
    with pytest.raises(ValueError):
        ConversationWorkload(20, 5, 3, turns=2, think_time_s=-1)


def test_the_load_loop_takes_a_conversations_turns_as_its_results() -> None:
    cfg = LoadConfig(rate=math.inf, max_concurrency=2, num_requests=3)

    async def send(item: int, run_start: float) -> list[RequestResult]:
        return [_ok(0.01, 0.02, 2) for _ in range(4)]

    out = asyncio.run(run_load(cfg, iter(range(10)), send, 0, _quiet(cfg)))
    assert len(out.results) == 12 and all(r.ok for r in out.results)
