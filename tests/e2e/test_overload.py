"""Issue 18: admission at the edge. Bursts far beyond what the pipeline holds at once are
served from the edge queue, the excess is refused there before any node sees it, nothing is
refused after its prefill ran, and every allocator is back at baseline afterwards."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.aclient import metric
from tests.support.cluster import Cluster, Server, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_ACTIVE, EDGE_CAPACITY = 512, 1024  # the proxy's defaults: the advertised capacity
BODY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    c = start_cluster(tiny_model_dir, (1, 1, 0))
    try:
        yield c
    finally:
        c.close()


Answer = tuple[int, str | None, str | None]  # status, error code and message's start


async def _one(session: aiohttp.ClientSession, url: str) -> Answer:
    async with session.post(f"{url}/v1/completions", json=BODY) as resp:
        body = await resp.json(content_type=None)
        if resp.status == 200:
            return 200, None, None
        assert resp.headers.get("Retry-After"), body
        return resp.status, body["error"]["code"], body["error"]["message"][:40]


async def _counters(session: aiohttp.ClientSession, proxy: str, prefill: str) -> Counter[str]:
    """The counters a burst moves: what the prefill node computed, what the edge did."""
    return Counter(
        {
            "prefilled": await metric(session, prefill, "pdserve_node_requests_total"),
            "admitted": await metric(
                session, proxy, "pdserve_edge_exits_total", outcome="admitted"
            ),
            "rejected": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="rejected"
            ),
            "at_edge": await metric(session, proxy, "pdserve_edge_rejections_total"),
            "completed": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="length"
            ),
            "failed": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="server_error"
            ),
            "cancelled": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="cancelled"
            ),
        }
    )


def _burst(
    cluster: Cluster, n: int
) -> tuple[list[tuple[int, str | None, str | None]], Counter[str]]:
    """`n` requests sent at once; their answers, and how far each counter moved."""
    assert cluster.proxy is not None
    proxy = cluster.proxy.url
    prefill = _node(cluster, "prefill").url

    async def main() -> tuple[list[Answer], Counter[str]]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            before = await _counters(session, proxy, prefill)
            answers = await asyncio.gather(*(_one(session, proxy) for _ in range(n)))
            after = await _counters(session, proxy, prefill)
        moved = Counter({k: after[k] - before[k] for k in after})
        return answers, moved

    return asyncio.run(main())


def test_a_burst_of_600_is_served_whole_from_the_edge_queue(cluster: Cluster) -> None:
    """600 at once is more than the pipeline holds (the decode node's 64 sequences, as many
    waiting prefilled) but well inside the advertised capacity: all of it completes."""
    answers, moved = _burst(cluster, 600)
    assert Counter(status for status, _, _ in answers) == {200: 600}
    assert moved["prefilled"] == moved["admitted"] == moved["completed"] == 600
    assert moved["rejected"] == moved["failed"] == 0
    cluster.wait_baseline(timeout=30)


def test_a_burst_beyond_capacity_is_refused_at_the_edge_only_for_the_excess(
    cluster: Cluster,
) -> None:
    """2,000 at once: at least the advertised capacity (max active + edge queue) completes;
    the rest get 503 + Retry-After at the edge, before any node saw them: the prefill node
    computed exactly the requests that completed, none was refused after its prefill."""
    answers, moved = _burst(cluster, 2000)
    statuses = Counter(status for status, _, _ in answers)
    refused = [a for a in answers if a[0] != 200]
    assert statuses[200] >= MAX_ACTIVE + EDGE_CAPACITY, Counter(answers)
    assert {(status, code) for status, code, _ in refused} == {(503, "overloaded")}
    assert moved["prefilled"] == moved["admitted"] == moved["completed"] == statuses[200]
    # the metrics add up: admitted = completed + cancelled + failed; refused = rejected
    assert moved["admitted"] == moved["completed"] + moved["cancelled"] + moved["failed"]
    assert moved["rejected"] == moved["at_edge"] == len(refused)
    cluster.wait_baseline(timeout=30)


def _node(cluster: Cluster, role: str) -> Server:
    return next(p for p in cluster.nodes() if p.name.startswith(role))
