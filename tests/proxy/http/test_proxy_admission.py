"""The edge behind the HTTP layer: `X-Request-Deadline-Ms` is the client's patience for
admission (a bad value is a 400 naming the header), refusals are 503s with Retry-After and an
OpenAI error body, counted as `rejected`, never as server errors."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.edge import EdgeConfig, EdgeGatedBackend, EdgeMetrics, EdgeQueue
from proxy.http.backend import GenerationRequest, TokenChunk, TokenStream
from proxy.http.server import DEADLINE_HEADER, build_app
from proxy.metrics import ProxyMetrics
from tests.support.proxy_harness import MAX_MODEL_LEN, MODEL, ProxyHarness

BODY = {"prompt": "hi", "max_tokens": 1}


class Gate:
    """A backend whose requests each finish with one token once `open` is set."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.seen: list[GenerationRequest] = []

    async def generate(self, req: GenerationRequest) -> TokenStream:
        self.seen.append(req)
        await self.open.wait()
        yield TokenChunk([5], "length")


async def _post(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=BODY, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf", "1e12"])
def test_a_bad_deadline_header_is_a_400_naming_it(proxy: ProxyHarness, value: str) -> None:
    url = proxy.base_url + "/v1/completions"
    status, _, body = asyncio.run(_post(url, {DEADLINE_HEADER: value}))
    assert status == 400 and body["error"]["param"] == DEADLINE_HEADER, body


def test_the_deadline_header_bounds_the_wait_at_the_edge(proxy: ProxyHarness) -> None:
    gate, metrics = Gate(), CollectorRegistry()
    edge = EdgeQueue(EdgeConfig(max_active=1, capacity=4, deadline_s=30.0), EdgeMetrics(metrics))
    app = build_app(
        EdgeGatedBackend(gate, edge), proxy.tokenizer, MODEL, MAX_MODEL_LEN,
        hooks=ProxyMetrics(metrics),
    )  # fmt: skip
    url = f"http://127.0.0.1:{proxy.serve(app)}/v1/completions"

    async def scenario() -> None:
        first = asyncio.ensure_future(_post(url, {}))  # takes the one slot and waits
        while not gate.seen:
            await asyncio.sleep(0.01)
        status, headers, body = await _post(url, {DEADLINE_HEADER: "150"})
        assert status == 503 and body["error"]["code"] == "overloaded", body
        assert "waited 0.15 s" in body["error"]["message"] and headers["Retry-After"] == "1"
        gate.open.set()
        assert (await first)[0] == 200
        status, _, _ = await _post(url, {DEADLINE_HEADER: "5000"})  # room again: served
        assert status == 200 and gate.seen[-1].patience_s == 5.0

    proxy.run(scenario())
    sample = metrics.get_sample_value
    assert sample("pdserve_edge_rejections_total", {"reason": "expired"}) == 1
    labels = {"endpoint": "completions", "outcome": "rejected"}
    assert sample("pdserve_proxy_requests_total", labels) == 1
    labels = {"endpoint": "completions", "outcome": "server_error"}
    assert not sample("pdserve_proxy_requests_total", labels)
