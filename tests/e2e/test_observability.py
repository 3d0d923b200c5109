"""Issue 7: `/metrics` on every process and the per-request ownership trace, with real
processes on loopback (1P1D)."""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from common.tiny.corpus import CORPUS
from common.wire.sampling_params import SamplingParams
from tests.support.aclient import Request, metric, sample_sum, stream_completion, until
from tests.support.cluster import Cluster, start_cluster
from tests.support.http import http_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# Causal order of a disaggregated request's boundaries, with the owner of each, without KV
# streaming (this module's proxy runs with it off; tests/e2e/test_kv_streaming.py checks the
# streamed order).
DISAGG_ROWS = [
    ("received", "proxy"),
    ("validated", "proxy"),
    ("tokenized", "proxy"),
    ("edge admitted", "proxy"),
    ("routed", "proxy"),
    ("prefill received", "prefill"),
    ("prefill admitted", "prefill"),
    ("prefill done", "prefill"),
    ("held", "prefill"),
    ("inter-stage queued", "proxy"),
    ("decode received", "decode"),
    ("decode reserved", "decode"),
    ("transfer start", "decode"),
    ("transfer done", "decode"),
    ("decode admitted", "decode"),
    ("first decode token", "decode"),
    ("finished", "proxy"),
    ("stream closed", "proxy"),
]


# Every request through the prefill pool, the inter-stage queue and a KV transfer: these tests
# follow a request through those stages (conditional disaggregation, `--disagg-mode auto`, may
# prefill one on the decode node instead; tests/e2e/test_service.py covers that).
ALWAYS = {"disagg_mode": "always"}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    c = start_cluster(tiny_model_dir, (1, 1, 0), proxy_args={**ALWAYS, "kv_streaming": "off"})
    try:
        yield c
    finally:
        c.close()


def _prompt(tokenizer: Tokenizer, n: int, at: int) -> str:
    return tokenizer.decode(tokenizer.encode(CORPUS[at:])[:n]).rstrip("\ufffd")


def _trace(cluster: Cluster, request_id: str) -> dict[str, Any]:
    assert cluster.proxy is not None
    return http_json(f"{cluster.proxy.url}/debug/requests/{request_id}/trace")


def _owners(cluster: Cluster) -> dict[str, str]:
    prefill, decode = cluster.nodes()
    return {"proxy": "proxy", "prefill": prefill.url, "decode": decode.url}


def test_trace_of_a_finished_request_is_complete_ordered_and_owned(
    cluster: Cluster, tokenizer: Tokenizer
) -> None:
    assert cluster.proxy is not None
    body = {"prompt": _prompt(tokenizer, 200, 10), "max_tokens": 8, "temperature": 0}

    async def run() -> Any:
        async with aiohttp.ClientSession() as s:
            return await stream_completion(s, cluster.proxy.url, {**body, "ignore_eos": True})

    res = asyncio.run(run())
    assert res.done and res.error is None
    rid = res.headers["X-Request-Id"]
    trace = _trace(cluster, rid)
    assert trace["request_id"] == rid and trace["outcome"] == "length"
    rows = trace["rows"]
    times = [r["t"] for r in rows]
    assert times == sorted(times)
    owners = _owners(cluster)
    seen = [(r["event"], r["owner"]) for r in rows]
    want = [(event, owners[who]) for event, who in DISAGG_ROWS]
    # Every boundary is there once, with its owner, and time order is causal order.
    assert [row for row in seen if row in want] == want, seen
    assert next(r for r in rows if r["event"] == "routed")["detail"].endswith(owners["prefill"])
    assert next(r for r in rows if r["event"] == "dispatched")["detail"] == owners["decode"]
    # One structured log line per finished request, holding the same trace.
    lines = [line for line in cluster.proxy.log_path.read_text().splitlines() if rid in line]
    (logged,) = [json.loads(line[line.index("{") :]) for line in lines if '{"trace"' in line]
    assert logged["trace"]["request_id"] == rid
    assert [r["event"] for r in logged["trace"]["rows"]][-1] == "stream closed"
    # An unknown id: a 404 with an OpenAI-style body.
    with pytest.raises(urllib.error.HTTPError) as err:
        _trace(cluster, "cmpl-nope")
    assert err.value.code == 404
    assert json.loads(err.value.read())["error"]["code"] == "trace_not_found"


def test_trace_of_a_cancelled_request_names_the_stage_and_the_node_that_cancelled(
    cluster: Cluster, tokenizer: Tokenizer
) -> None:
    assert cluster.proxy is not None
    body = {"prompt": _prompt(tokenizer, 40, 500), "max_tokens": 1500, "ignore_eos": True}
    _, decode = cluster.nodes()

    async def run() -> str:
        async with aiohttp.ClientSession() as s:
            req = Request(s, cluster.proxy.url, body)

            async def streaming() -> bool:
                return req.result.events >= 5

            await until(streaming, 60.0, "five tokens streamed")
            await req.drop()
            rid = req.result.headers["X-Request-Id"]

            async def acknowledged() -> bool:  # the node's answer to the proxy's Cancel
                rows = _trace(cluster, rid)["rows"]
                return any(r["event"].startswith("cancel") and r["owner"] != "proxy" for r in rows)

            await until(acknowledged, 5.0, "the decode node's cancel in the trace")
            return rid

    rid = asyncio.run(run())
    cluster.wait_baseline(5.0)
    trace = _trace(cluster, rid)
    assert trace["outcome"] == "cancelled"
    rows = trace["rows"]
    events = [r["event"] for r in rows]
    cancelled = rows[events.index("cancelled")]
    assert cancelled["owner"] == "proxy" and cancelled["detail"] == "disconnect during decode"
    # The decode node answers the Cancel: it found the request running, or had already
    # aborted it when the dropped stream reached it first.
    (ack,) = [r for r in rows if r["event"].startswith("cancel") and r["owner"] != "proxy"]
    assert ack["owner"] == decode.url
    assert (ack["event"], ack["detail"]) in (
        ("cancel acknowledged", "running"),
        ("cancel: not held", ""),
    )
    assert events.index("first decode token") < events.index("cancelled")
    assert "stream closed" in events and "finished" not in events
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)


PROXY_FAMILIES = [
    "pdserve_proxy_requests_total",
    "pdserve_proxy_requests_in_flight",
    "pdserve_proxy_ttft_seconds_count",
    "pdserve_proxy_itl_seconds_count",
    "pdserve_proxy_relay_seconds_count",
    "pdserve_proxy_e2e_seconds_count",
    "pdserve_edge_queue_depth",
    "pdserve_edge_wait_seconds_count",
    "pdserve_interstage_queue_depth",
    "pdserve_interstage_wait_seconds_count",
    "pdserve_proxy_cancellations_total",
    "pdserve_proxy_migrations_total",
    "pdserve_proxy_prefill_retries_total",
]
NODE_FAMILIES = [
    "pdserve_node_requests_total",
    "pdserve_kv_blocks",
    "pdserve_queue_depth",
    "pdserve_queue_wait_seconds_count",
    "pdserve_transfer_seconds_count",
    "pdserve_transfer_bytes_sum",
    "pdserve_transfer_failures_total",
    "pdserve_cancellations_total",
    "pdserve_lease_expiries_total",
    "pdserve_kv_wait_timeouts_total",
    "pdserve_engine_step_seconds_count",
]


def _metrics_text(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _has(text: str, name: str) -> bool:
    return any(line.startswith((name + " ", name + "{")) for line in text.splitlines())


def test_metrics_on_every_process_after_traffic_add_up(
    cluster: Cluster, tokenizer: Tokenizer
) -> None:
    assert cluster.proxy is not None
    prefill, decode = cluster.nodes()
    before = {p.url: _metrics_text(p.url) for p in (cluster.proxy, prefill, decode)}
    prompts = [_prompt(tokenizer, n, 100 * i) for i, n in enumerate([5, 17, 40, 130, 300])]

    async def run() -> list[Any]:
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(
                *(
                    stream_completion(
                        s, cluster.proxy.url, {"prompt": p, "max_tokens": 6, "ignore_eos": True}
                    )
                    for p in prompts
                )
            )

    results = asyncio.run(run())
    assert all(r.done and r.error is None for r in results)
    cluster.wait_baseline()
    after = {p.url: _metrics_text(p.url) for p in (cluster.proxy, prefill, decode)}
    proxy = after[cluster.proxy.url]
    for name in PROXY_FAMILIES:
        assert _has(proxy, name), name
    # The proxy's paced garbage collector (every 0.5 s; the first may not have come yet)
    deadline = time.monotonic() + 10.0
    while not _has(_metrics_text(cluster.proxy.url), "pdserve_gc_pause_seconds_count"):
        assert time.monotonic() < deadline, "no paced garbage collection in 10 s"
        time.sleep(0.1)
    for node in (prefill, decode):
        for name in NODE_FAMILIES:
            assert _has(after[node.url], name), (node.name, name)

    def delta(url: str, name: str, **labels: str) -> float:
        return sample_sum(after[url], name, **labels) - sample_sum(before[url], name, **labels)

    n = len(prompts)
    assert delta(cluster.proxy.url, "pdserve_proxy_requests_total", outcome="length") == n
    assert delta(cluster.proxy.url, "pdserve_proxy_ttft_seconds_count") == n
    assert delta(cluster.proxy.url, "pdserve_proxy_e2e_seconds_count") == n
    assert delta(cluster.proxy.url, "pdserve_proxy_itl_seconds_count") == n * 5
    assert delta(cluster.proxy.url, "pdserve_interstage_wait_seconds_count") == n
    assert delta(cluster.proxy.url, "pdserve_edge_wait_seconds_count") == n
    assert sample_sum(proxy, "pdserve_proxy_requests_in_flight") == 0
    # KV transfer: one per request, bytes = blocks moved x bytes per block.
    state = prefill.state()
    block_size, block_bytes = state["capacity"]["block_size"], state["capacity"]["block_bytes"]
    blocks = sum(math.ceil(len(tokenizer.encode(p)) / block_size) for p in prompts)
    assert delta(prefill.url, "pdserve_transfer_seconds_count") == n
    assert delta(prefill.url, "pdserve_transfer_bytes_sum") == blocks * block_bytes
    assert delta(prefill.url, "pdserve_queue_wait_seconds_count", queue="prefill") == n
    assert delta(decode.url, "pdserve_queue_wait_seconds_count", queue="decode") == n
    assert delta(decode.url, "pdserve_node_requests_total", outcome="admitted") == n
    free = sample_sum(after[decode.url], "pdserve_kv_blocks", state="free")
    assert free == decode.state()["blocks"]["total"]
    # Where decode time goes: the decode node wrote tokens 2..6 of each stream as 5 lines
    # (4 gaps each); every content event the proxy wrote counted its relay time.
    assert delta(decode.url, "pdserve_node_itl_seconds_count") == n * 4
    assert n <= delta(cluster.proxy.url, "pdserve_proxy_relay_seconds_count") <= n * 6
    # Engine steps by phase: the phases of each batch kind add up to its total.
    for node, kind in ((prefill, "prefill"), (decode, "decode")):
        steps = delta(node.url, "pdserve_engine_step_seconds_count", phase="total", batch=kind)
        assert steps >= (1 if kind == "prefill" else 5), (node.name, steps)
        parts = sum(
            delta(node.url, "pdserve_engine_step_seconds_sum", phase=phase, batch=kind)
            for phase in ("admit", "schedule", "forward", "sample", "output")
        )
        total = delta(node.url, "pdserve_engine_step_seconds_sum", phase="total", batch=kind)
        assert parts == pytest.approx(total, rel=1e-6) and total > 0
        forward = delta(node.url, "pdserve_engine_step_seconds_sum", phase="forward", batch=kind)
        assert 0 < forward <= total


def test_a_second_turn_moves_only_the_blocks_the_decode_node_lacks(
    cluster: Cluster, tokenizer: Tokenizer, offline_token_ids: Any
) -> None:
    """Issue 14, delta transfer: the decode node keeps turn one's prompt and answer cached,
    so turn two (which contains both) reserves and transfers only the new blocks, and its
    output is the offline engine's (which computes everything, caching nothing)."""
    assert cluster.proxy is not None
    _, decode = cluster.nodes()
    turn1 = _prompt(tokenizer, 150, 2000)
    body = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}

    async def run() -> tuple[Any, Any, float, float]:
        async with aiohttp.ClientSession() as s:
            before = await metric(s, decode.url, "pdserve_kv_blocks_cached_total")
            first = await stream_completion(s, cluster.proxy.url, {**body, "prompt": turn1})
            turn2 = turn1 + first.text + " And then what happened?"
            second = await stream_completion(s, cluster.proxy.url, {**body, "prompt": turn2})
            after = await metric(s, decode.url, "pdserve_kv_blocks_cached_total")
            return first, second, before, after

    first, second, before, after = asyncio.run(run())
    assert first.done and second.done and second.error is None
    turn2 = turn1 + first.text + " And then what happened?"
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = offline_token_ids(tokenizer.encode(turn2), sp)
    assert second.text == tokenizer.decode(want)
    assert after - before >= 150 // 16 - 1  # turn one's full prompt blocks, at least
    rows = [r["event"] for r in _trace(cluster, second.headers["X-Request-Id"])["rows"]]
    assert any(e.startswith("decode cache hit") for e in rows), rows
    moved = next(e for e in rows if e.startswith("kv moved"))
    n_moved, n_total = (int(x) for x in moved.split()[2:5:2])
    assert n_moved < n_total, moved
    cluster.wait_baseline()
