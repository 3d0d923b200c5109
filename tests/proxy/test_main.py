"""The assembled proxy (`proxy.main.start_proxy`) over stub nodes, through its HTTP API:
OpenAI requests, metrics, overload answers and the admin routes."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from common.text.tokenizer import Tokenizer
from proxy.main import start_proxy
from proxy.settings import ProxySettings
from tests.support.node_stubs import FAST, StubNode, run, stubs


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
                timeouts=FAST,
            )
            proxy = await start_proxy(settings)
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                    await _openai_calls(s, proxy.url, tokenizer, decode)
            finally:
                await proxy.stop()

    run(body())


async def _openai_calls(
    s: aiohttp.ClientSession, url: str, tokenizer: Tokenizer, decode: StubNode
) -> None:
    async with s.get(url + "/health") as r:
        assert r.status == 200
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["text"] == tokenizer.decode([7, 8, 9, 10])
    decode.max_streams = 0  # full: the next request waits in the one-slot queue
    waiting = await s.post(url + "/v1/completions", json={**body, "stream": True})
    assert waiting.status == 200  # its first token is out
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "overloaded"
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    assert "pdserve_interstage_queue_depth 1.0" in text
    assert 'pdserve_proxy_requests_total{endpoint="completions",outcome="length"} 1.0' in text
    assert "pdserve_proxy_ttft_seconds_count 2.0" in text  # the waiting one has its first
    waiting.close()
    async with s.get(url + "/admin/nodes") as r:
        assert [n["role"] for n in (await r.json())["nodes"]] == ["prefill", "decode"]
