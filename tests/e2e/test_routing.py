"""Issue 14, the reference example ("the cache hit that loses") with real processes: two
prefill nodes, A holding a long prefix of the prompt in its cache, B not. With A idle the
cost router sends the prompt to A (its cache saves the most); with real queued work on A it
sends it to B, whose estimate is then lower. Cache-affinity sends it to A both times. The
trace's "routed" row carries the numbers behind each decision.

Both prefill nodes run 64-token prefill chunks and sleep 20 ms a step, so that a queue of a
few thousand prompt tokens lasts long enough (seconds) to route against; the queue itself is
real requests sent to A.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from common.tiny.corpus import CORPUS
from tests.support.aclient import get_json, metric, stream_completion, until
from tests.support.cluster import Cluster, Server
from tests.support.http import http_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFIX_TOKENS = 768


@dataclass
class Deployment:
    cluster: Cluster
    a: Server
    b: Server
    cost: Server
    affinity: Server


@pytest.fixture(scope="module")
def deployment(tiny_model_dir: Path) -> Iterator[Deployment]:
    cluster = Cluster(tiny_model_dir)
    try:
        slow = {"debug_step_delay": 0.02, "max_num_batched_tokens": 64}
        a = cluster.node("prefill", "prefill-a", wait=False, **slow)
        b = cluster.node("prefill", "prefill-b", wait=False, **slow)
        d = cluster.node("decode", "decode", wait=False)
        cluster.wait_all()
        # Every prompt to the prefill pool (conditional disaggregation would prefill some on
        # the decode node): these tests are about where among the prefill nodes.
        common = {"poll_interval_s": 0.1, "disagg_mode": "always"}
        cost = cluster.start_proxy([a, b], [d], routing="cost", **common)
        affinity = cluster.start_proxy([a, b], [d], routing="cache-affinity", **common)
        yield Deployment(cluster, a, b, cost, affinity)
    finally:
        cluster.close()


def _ids(tokenizer: Tokenizer, at: int, n: int) -> list[int]:
    return tokenizer.encode(CORPUS[at:])[:n]


async def _prefill_directly(
    session: aiohttp.ClientSession, node: Server, rid: str, prompt: list[int]
) -> None:
    """A prefill on `node` itself (not through a proxy), its KV freed half a second later."""
    msg = {
        "type": "prefill_request",
        "request_id": rid,
        "prompt_token_ids": prompt,
        "sampling": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True},
        "lease_s": 0.5,
    }
    async with session.post(f"{node.url}/internal/prefill", json=msg) as resp:
        assert resp.status == 200, await resp.text()


async def _routed(session: aiohttp.ClientSession, proxy: Server, prompt: str) -> str:
    res = await stream_completion(
        session, proxy.url, {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    )
    assert res.done and res.error is None, res.error
    trace = http_json(f"{proxy.url}/debug/requests/{res.headers['X-Request-Id']}/trace")
    return next(r["detail"] for r in trace["rows"] if r["event"] == "routed")


def _row(nodes: dict[str, Any], url: str) -> dict[str, Any]:
    return next(n for n in nodes["nodes"] if n["url"] == url)


def test_the_cost_router_weighs_the_cache_against_the_queue(
    deployment: Deployment, tokenizer: Tokenizer
) -> None:
    d = deployment
    prefix = _ids(tokenizer, 0, PREFIX_TOKENS)

    def prompt(suffix_at: int) -> str:
        return tokenizer.decode(prefix + _ids(tokenizer, suffix_at, 64))

    async def scenario(session: aiohttp.ClientSession) -> None:
        # A caches the prefix; B prefills something else (so both have measured their rate).
        await _prefill_directly(session, d.a, "seed-a", prefix + _ids(tokenizer, 9000, 32))
        await _prefill_directly(session, d.b, "seed-b", _ids(tokenizer, 5000, PREFIX_TOKENS))

        async def both_proxies_see_the_cache() -> bool:
            for proxy in (d.cost, d.affinity):
                row = _row(await get_json(session, f"{proxy.url}/admin/nodes"), d.a.url)
                cache = row["prefix_cache"]
                if not cache or not cache["synced"] or cache["blocks"] < PREFIX_TOKENS // 16:
                    return False
            return True

        await until(both_proxies_see_the_cache, 20.0, "the proxies learning A's cache")
        # A idle: its cache wins under both policies.
        for proxy in (d.cost, d.affinity):
            detail = await _routed(session, proxy, prompt(3000))
            assert detail.endswith(d.a.url), detail
        # Real work queued on A: long prompts sent to it directly, not yet computed.
        queue = [
            asyncio.create_task(
                _prefill_directly(session, d.a, f"q{i}", _ids(tokenizer, 10000 + 1500 * i, 1000))
            )
            for i in range(6)
        ]  # fmt: skip
        try:

            async def queued() -> bool:
                for proxy in (d.cost, d.affinity):
                    row = _row(await get_json(session, f"{proxy.url}/admin/nodes"), d.a.url)
                    if (row["queued_prefill_tokens"] or 0) < 3000:
                        return False
                return True

            await until(queued, 20.0, "A's queue showing at both proxies")
            cost_detail, affinity_detail = await asyncio.gather(
                _routed(session, d.cost, prompt(4000)), _routed(session, d.affinity, prompt(4500))
            )
        finally:
            await asyncio.gather(*queue, return_exceptions=True)
        assert cost_detail.endswith(d.b.url), cost_detail
        assert cost_detail.startswith("cost: ") and "best other " + d.a.url in cost_detail
        assert f"{PREFIX_TOKENS}/" in cost_detail.split("best other")[1]  # A's hit, noted
        assert affinity_detail.endswith(d.a.url), affinity_detail
        disagreed = await metric(
            session, d.cost.url, "pdserve_proxy_routing_decisions_total",
            policy="cost", cache_vs_queue="disagree",
        )  # fmt: skip
        assert disagreed >= 1

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await scenario(session)

    asyncio.run(main())
    d.cluster.wait_baseline(30.0)


def test_reset_prefix_cache_empties_every_node_and_the_proxy_index(
    deployment: Deployment, tokenizer: Tokenizer
) -> None:
    """POST /admin/reset_prefix_cache (what bench-serve --reset-prefix-cache sends before
    each run): every node forgets its unused cached blocks, the proxy's index follows their
    "removed" events, and a prompt computed before is computed in full again."""
    d = deployment
    prompt = tokenizer.decode(_ids(tokenizer, 6000, 300))

    async def cached(session: aiohttp.ClientSession) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        async with session.post(f"{d.cost.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    async def index_blocks(session: aiohttp.ClientSession) -> int:
        nodes = (await get_json(session, f"{d.cost.url}/admin/nodes"))["nodes"]
        return sum((n["prefix_cache"] or {}).get("blocks", 0) for n in nodes)

    async def scenario(session: aiohttp.ClientSession) -> None:
        await cached(session)
        assert await cached(session) > 0  # the second time, the prefill node had it
        await until(lambda: _positive(index_blocks(session)), 20.0, "the index seeing it")
        await until(lambda: _idle(session, d), 20.0, "no request holding blocks")
        async with session.post(f"{d.cost.url}/admin/reset_prefix_cache") as resp:
            assert resp.status == 200, await resp.text()
            reset = await resp.json()
        assert {n["url"] for n in reset["nodes"]} == {n.url for n in d.cluster.nodes()}
        assert reset["blocks"] >= 300 // 16
        for node in (d.a, d.b):
            keys = (await get_json(session, f"{node.url}/internal/kv_cache"))["keys"]
            assert keys == [], node.url
        await until(lambda: _zero(index_blocks(session)), 20.0, "the index emptied")
        assert await cached(session) == 0

    asyncio.run(_with_session(scenario))
    d.cluster.wait_baseline(30.0)


async def _with_session(fn: Any) -> None:
    async with aiohttp.ClientSession() as session:
        await fn(session)


async def _positive(value: Any) -> bool:
    return await value > 0


async def _zero(value: Any) -> bool:
    return await value == 0


async def _idle(session: aiohttp.ClientSession, d: Deployment) -> bool:
    for node in (d.a, d.b):
        st = await get_json(session, f"{node.url}/state")
        if any(st["requests"].values()):
            return False
    return True
