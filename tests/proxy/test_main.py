"""The assembled proxy (`proxy.main.start_proxy`) over stub nodes, through its HTTP API:
OpenAI requests, metrics, overload answers and the admin routes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

from common.text.tokenizer import Tokenizer
from proxy.main import ProxyParts, start_proxy
from proxy.settings import ProxySettings
from tests.support.node_stubs import FAST, StubNode, eventually, run, stubs


def _gauge(metrics: CollectorRegistry, name: str) -> float:
    return metrics.get_sample_value(name) or 0.0


def test_the_proxy_serves_openai_requests_metrics_and_overload(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)

    async def body() -> None:
        prefill, decode = StubNode("prefill"), StubNode("decode")
        async with stubs(prefill, decode):
            settings = ProxySettings(
                model=str(tiny_model_dir),
                port=0,
                prefill=(prefill.url,),
                decode=(decode.url,),
                interstage_capacity=1,
                max_active_requests=2,
                edge_queue_capacity=0,
                timeouts=FAST,
            )
            proxy = await start_proxy(settings)
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                    await _openai_calls(s, proxy.url, tokenizer, prefill, decode, proxy.parts)
            finally:
                await proxy.stop()

    run(body())


async def _openai_calls(
    s: aiohttp.ClientSession,
    url: str,
    tokenizer: Tokenizer,
    prefill: StubNode,
    decode: StubNode,
    parts: ProxyParts,
) -> None:
    async with s.get(url + "/health") as r:
        assert r.status == 200
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["text"] == tokenizer.decode([7, 8, 9, 10])
    decode.max_streams = 0  # full: the next request is prefilled and waits for decode
    waiting = await s.post(url + "/v1/completions", json={**body, "stream": True})
    assert waiting.status == 200  # its first token is out; it holds the pre-decode budget (1)
    held = asyncio.ensure_future(s.post(url + "/v1/completions", json=body))
    await eventually(lambda: _gauge(parts.metrics, "pdserve_edge_queue_depth") == 1)
    # 2 in the proxy: one inside, one waiting at the edge (no room before decode); the next
    # is refused at once, before any node sees it
    calls = len(prefill.calls)
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "overloaded"
    assert len(prefill.calls) == calls
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    assert "pdserve_interstage_queue_depth 1.0" in text
    assert 'pdserve_proxy_requests_total{endpoint="completions",outcome="length"} 1.0' in text
    assert 'pdserve_proxy_requests_total{endpoint="completions",outcome="rejected"} 1.0' in text
    assert 'pdserve_edge_rejections_total{reason="full"} 1.0' in text
    assert 'pdserve_edge_predecode{what="requests"} 1.0' in text  # prefilled, not decoding
    assert 'pdserve_edge_predecode{what="prefill_tokens"} 0.0' in text
    assert 'pdserve_edge_predecode_limit{what="requests"} 1.0' in text
    assert "pdserve_proxy_ttft_seconds_count 2.0" in text  # the waiting one has its first
    decode.max_streams = None  # decode frees up: both finish, the held one admitted in turn
    async with await held as r:
        assert r.status == 200
    assert await waiting.text()
    async with s.get(url + "/admin/nodes") as r:
        assert [n["role"] for n in (await r.json())["nodes"]] == ["prefill", "decode"]


def test_multi_hooks_pass_on_every_hook() -> None:
    """A hook added to ProxyHooks and not forwarded by MultiHooks would silently never fire
    (the relay-time histogram stayed empty that way)."""
    import inspect

    from proxy.http.hooks import ProxyHooks
    from proxy.trace import MultiHooks

    hooks = [
        n for n, _ in inspect.getmembers(ProxyHooks, inspect.isfunction) if n.startswith("on_")
    ]
    assert "on_relayed" in hooks
    for name in hooks:
        assert getattr(MultiHooks, name) is not getattr(ProxyHooks, name), name


def test_multi_hooks_pass_per_token_hooks_to_the_hooks_that_take_them() -> None:
    from proxy.http.hooks import ProxyHooks
    from proxy.trace import MultiHooks

    seen: list[tuple[str, object]] = []

    class Recorder(ProxyHooks):
        def on_tokens(self, request_id: str, num_tokens: int) -> None:
            seen.append(("tokens", num_tokens))

        def on_relayed(self, request_id: str, seconds: float) -> None:
            seen.append(("relayed", seconds))

    multi = MultiHooks(ProxyHooks(), Recorder())
    multi.on_tokens("r", 3)
    multi.on_relayed("r", 0.5)
    assert seen == [("tokens", 3), ("relayed", 0.5)]
