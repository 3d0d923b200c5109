"""Issue 15, item 4: KV streamed while the prompt computes (`--kv-streaming on`).

A 1P1D cluster of real processes whose prefill node computes at most 32 prompt tokens a
step and sleeps 0.1 s after each, so a 300-token prompt takes ten steps, and its finished
block groups move to the decode node while later chunks compute; the last group is posted
1 s late, so a request can be caught after it was committed. Checked: the output equals
the offline engine's on every KV backend; the trace shows the groups and the exposed time;
a cancel while groups are moving, one after the last group, one before any decode node
asked, the prefill call dropped, and a lease that lapses on KV nobody asked for all end with
every node's allocator at its baseline (through /state).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from common.tiny.corpus import CORPUS
from common.wire.sampling_params import SamplingParams
from kv_transfer.config import BACKENDS
from tests.support.aclient import (
    Request,
    corpus_prompt,
    get_json,
    greedy_body,
    metric,
    offline_text,
    run_with_session,
    until,
)
from tests.support.cluster import Cluster, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHUNK = 32  # prompt tokens a prefill step
# A streamed request's boundaries, in causal order (the prompt takes ten steps, so the
# decode node reserves and asks while it computes).
STREAMED_ROWS = [
    "routed", "prefill received", "inter-stage queued", "decode received", "decode reserved",
    "transfer start", "prefill done", "transfer done", "decode admitted",
    "first decode token", "finished", "stream closed",
]  # fmt: skip
STEP_DELAY_S = 0.1
LAST_GROUP_DELAY_S = 1.0  # the last group is posted this late (fault injection)


def _start(model_dir: Path, backend: str) -> Cluster:
    cluster = Cluster(model_dir, kv_backend=backend)
    try:
        prefill = cluster.node(
            "prefill", "prefill", wait=False, max_num_batched_tokens=CHUNK,
            debug_step_delay=STEP_DELAY_S, debug_transfer_delay=LAST_GROUP_DELAY_S,
        )  # fmt: skip
        decode = cluster.node("decode", "decode", wait=False)
        cluster.wait_all()
        cluster.start_proxy(prefill=[prefill], decode=[decode], kv_streaming="on")
    except BaseException:
        cluster.close()
        raise
    return cluster


@pytest.fixture(scope="module")
def streaming(tiny_model_dir: Path) -> Iterator[Cluster]:
    cluster = _start(tiny_model_dir, "nixl")
    try:
        yield cluster
    finally:
        cluster.close()


def _nodes(cluster: Cluster) -> tuple[Server, Server]:
    prefill, decode = cluster.nodes()
    return prefill, decode


async def _trace(session: aiohttp.ClientSession, proxy: Server, rid: str) -> list[dict]:
    trace = await get_json(session, f"{proxy.url}/debug/requests/{rid}/trace")
    return trace["rows"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_kv_serves_equal_to_offline(
    tiny_model_dir: Path,
    streaming: Cluster,
    backend: str,
    tokenizer: Tokenizer,
    offline_token_ids: Callable,
) -> None:
    cluster = streaming if backend == "nixl" else _start(tiny_model_dir, backend)
    try:
        body = greedy_body(corpus_prompt(tokenizer, 300, 50 * len(backend)), 12)
        want = offline_text(tokenizer, offline_token_ids, body)
        assert cluster.proxy is not None
        proxy = cluster.proxy

        async def main(session: aiohttp.ClientSession) -> None:
            res = await Request(session, proxy.url, body).wait()
            assert res.error is None and res.done and res.text == want, res
            rows = await _trace(session, proxy, res.headers["X-Request-Id"])
            events = [r["event"] for r in rows]
            groups = [e for e in events if e.startswith("kv group")]
            assert len(groups) >= 2, events  # groups moved while later chunks computed
            assert any(e.startswith("kv landed") for e in events), events
            # The decode node was engaged before the prompt was done, and each boundary is
            # there once, in causal order.
            assert events.index("decode reserved") < events.index("prefill done"), events
            chain = [e for e in events if e in STREAMED_ROWS]
            assert chain == STREAMED_ROWS, events
            _, decode = _nodes(cluster)
            assert await metric(session, decode.url, "pdserve_kv_exposed_seconds_count") >= 1

        run_with_session(main)
        cluster.wait_baseline(timeout=10.0)
    finally:
        if cluster is not streaming:
            cluster.close()


def test_n_choices_fork_from_streamed_kv(
    streaming: Cluster, tokenizer: Tokenizer, offline_completion: Callable
) -> None:
    """Issue 19: a request of several choices whose KV streamed in groups: the decode node
    forks it once it landed, every choice the offline engine's."""
    prompt = corpus_prompt(tokenizer, 300, 7)
    sp = SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, n=3)
    done = offline_completion(tokenizer.encode(prompt), sp)
    want = [tokenizer.decode(t) for t in [done.token_ids, *[t for t, _ in done.more_choices]]]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.9, "seed": 3, "n": 3}
    body["ignore_eos"] = True
    assert streaming.proxy is not None
    proxy = streaming.proxy

    async def main(session: aiohttp.ClientSession) -> None:
        async with session.post(
            f"{proxy.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
        ) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert [c["text"] for c in out["choices"]] == want
        rows = await _trace(session, proxy, out["id"])
        assert any(r["event"].startswith("kv group") for r in rows)

    run_with_session(main)
    streaming.wait_baseline(timeout=10.0)


def test_a_second_turn_streams_only_the_blocks_the_decode_node_lacks(
    streaming: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """Delta transfer with streaming: the decode node has turn one cached, so turn two's
    streamed groups skip those blocks, and its output is the offline engine's."""
    assert streaming.proxy is not None
    proxy = streaming.proxy
    turn1 = corpus_prompt(tokenizer, 200, 3500)

    async def main(session: aiohttp.ClientSession) -> None:
        first = await Request(session, proxy.url, greedy_body(turn1, 8)).wait()
        body = greedy_body(turn1 + first.text + corpus_prompt(tokenizer, 150, 4200), 8)
        second = await Request(session, proxy.url, body).wait()
        assert second.text == offline_text(tokenizer, offline_token_ids, body), second
        events = [r["event"] for r in await _trace(session, proxy, second.headers["X-Request-Id"])]
        assert any(e.startswith("decode cache hit") for e in events), events
        assert any(e.startswith("kv group") for e in events), events
        moved = next(e for e in events if e.startswith("kv moved"))
        n_moved, n_total = (int(x) for x in moved.split()[2:5:2])
        assert n_moved < n_total, moved

    run_with_session(main)
    streaming.wait_baseline(timeout=10.0)


def test_cancel_while_groups_are_moving(
    streaming: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """The client goes while the prompt still computes and some groups have landed: both
    nodes stop, the write ends quiescent, every block comes back; the next request is
    exact (no late byte landed in a reused block)."""
    prefill, decode = _nodes(streaming)
    assert streaming.proxy is not None
    url = streaming.proxy.url

    async def main(session: aiohttp.ClientSession) -> None:
        before = await metric(session, decode.url, "pdserve_kv_groups_total")
        target = Request(session, url, greedy_body(corpus_prompt(tokenizer, 400, 900), 8))

        async def moving() -> bool:
            groups = await metric(session, decode.url, "pdserve_kv_groups_total")
            st = await get_json(session, f"{prefill.url}/state")
            return groups > before and st["requests"]["running"] == 1

        await until(moving, 60.0, "groups landing while the prompt computes")
        await target.drop()
        await _baseline(session, streaming)
        body = greedy_body(corpus_prompt(tokenizer, 300, 1500), 10)
        res = await Request(session, url, body).wait()
        assert res.text == offline_text(tokenizer, offline_token_ids, body), res

    run_with_session(main)
    streaming.wait_baseline(timeout=10.0)


def test_cancel_after_the_last_group_was_committed(
    streaming: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """The prompt is done and its last group committed (SENDING, posted late): the client
    goes; the write is aborted or finished, then both nodes free everything."""
    prefill, decode = _nodes(streaming)
    assert streaming.proxy is not None
    url = streaming.proxy.url

    async def main(session: aiohttp.ClientSession) -> None:
        target = Request(session, url, greedy_body(corpus_prompt(tokenizer, 300, 2200), 8))

        async def committed() -> bool:
            p = (await get_json(session, f"{prefill.url}/state"))["requests"]
            d = (await get_json(session, f"{decode.url}/state"))["requests"]
            return p["held"] == 1 and p["transferring"] == 1 and d["reserved"] == 1

        await until(committed, 60.0, "the last group committed, not yet landed")
        await target.drop()
        await _baseline(session, streaming)
        body = greedy_body(corpus_prompt(tokenizer, 300, 2600), 10)
        res = await Request(session, url, body).wait()
        assert res.text == offline_text(tokenizer, offline_token_ids, body), res

    run_with_session(main)
    streaming.wait_baseline(timeout=10.0)


def test_streamed_prefill_cancelled_or_dropped_before_any_decode_node_asked(
    streaming: Cluster, tokenizer: Tokenizer
) -> None:
    """Straight to the prefill node: a Cancel while it computes (no destination yet), and a
    call dropped after its KV handle came, both free everything."""
    prefill, _ = _nodes(streaming)
    ids = tokenizer.encode(CORPUS[3000:])[:300]

    async def main(session: aiohttp.ClientSession) -> None:
        for how in ("cancel", "drop"):
            rid = f"direct-{how}"
            resp = await _prefill_streamed(session, prefill, rid, ids, lease_s=30)
            accepted = json.loads(await resp.content.readline())
            assert accepted["type"] == "prefill_accepted" and accepted["kv"]["num_blocks"] == 19
            if how == "cancel":
                answer = await _post(session, f"{prefill.url}/internal/cancel", rid)
                assert answer["found"] and answer["stage"] in ("queued", "running"), answer
                last = json.loads(await resp.content.readline())
                assert last["error_code"] == "cancelled", last
            resp.close()
            await _baseline(session, streaming)

    run_with_session(main)


def test_the_lease_bounds_streamed_kv_nobody_asks_for(
    streaming: Cluster, tokenizer: Tokenizer
) -> None:
    """The prompt finishes with no TransferRequest: its KV is HELD under the lease, which
    lapses (nobody extends it) and frees every block; a TransferRequest then would fail."""
    prefill, _ = _nodes(streaming)
    ids = tokenizer.encode(CORPUS[5000:])[:100]

    async def main(session: aiohttp.ClientSession) -> None:
        expiries = await metric(session, prefill.url, "pdserve_lease_expiries_total")
        resp = await _prefill_streamed(session, prefill, "direct-lease", ids, lease_s=1.0)
        lines = [json.loads(line) async for line in resp.content if line.strip()]
        assert [x["type"] for x in lines] == ["prefill_accepted", "prefill_result"], lines
        assert lines[1]["kv"] is not None and lines[1]["kv"]["num_blocks"] == 7

        async def expired() -> bool:
            n = await metric(session, prefill.url, "pdserve_lease_expiries_total")
            return n == expiries + 1

        await until(expired, 10.0, "the lease of the held KV lapsing")
        await _baseline(session, streaming)

    run_with_session(main)


async def _prefill_streamed(
    session: aiohttp.ClientSession, node: Server, rid: str, ids: list[int], lease_s: float
) -> aiohttp.ClientResponse:
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    msg = {
        "type": "prefill_request", "request_id": rid, "prompt_token_ids": ids,
        "sampling": sampling.model_dump(mode="json"), "lease_s": lease_s,
    }  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=60)
    resp = await session.post(f"{node.url}/internal/prefill_streamed", json=msg, timeout=timeout)
    assert resp.status == 200, await resp.text()
    return resp


async def _post(session: aiohttp.ClientSession, url: str, rid: str) -> Any:
    body = {"type": "cancel", "request_id": rid}
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.json()


async def _baseline(session: aiohttp.ClientSession, cluster: Cluster) -> None:
    async def clean() -> bool:
        for node in cluster.nodes():
            st = await get_json(session, f"{node.url}/state")
            b, r = st["blocks"], st["requests"]
            if b["free"] != b["total"] or any(r.values()):
                return False
        return True

    await until(clean, 10.0, "every node back at its baseline")
    await asyncio.sleep(0)
