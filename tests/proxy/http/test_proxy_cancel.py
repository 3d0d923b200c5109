"""Client disconnects cancel the generation (engine blocks back at baseline); backend errors
become HTTP errors before the stream starts and a final SSE error event after."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest

from common.wire.sampling_params import SamplingParams
from proxy.http.backend import BackendError, GenerationRequest, TokenChunk, TokenStream
from proxy.http.server import build_app
from tests.support.proxy_harness import MODEL, OfflineEngine, ProxyHarness

# ~5 s of decoding on the tiny model: a test that sees the engine idle within 2 s cancelled it.
LONG = {"prompt": "The quick brown fox", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
JSON = {"Content-Type": "application/json"}


async def _read_then_drop(url: str, body: dict[str, Any], events: int) -> str:
    """Stream `body`, read `events` SSE events, then close the connection; the request id."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url, json=body)
        assert resp.status == 200
        for _ in range(events):
            line = await resp.content.readline()
            while line == b"\n":
                line = await resp.content.readline()
            assert line.startswith(b"data: {")
        resp.close()  # drops the connection
        return resp.headers["X-Request-Id"]


def _outcome(proxy: ProxyHarness, rid: str, timeout: float = 2.0) -> list[tuple[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not proxy.hooks.outcome(rid):
        time.sleep(0.01)
    return proxy.hooks.outcome(rid)


def test_disconnect_mid_stream_frees_blocks(proxy: ProxyHarness) -> None:
    url = proxy.base_url + "/v1/completions"
    rid = asyncio.run(_read_then_drop(url, {**LONG, "stream": True}, events=3))
    proxy.wait_idle(timeout=2.0)
    assert _outcome(proxy, rid) == [("cancelled", "disconnect")]  # the client left


async def _full_stream(url: str, body: dict[str, Any]) -> str:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        events = _events(await r.text())
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def test_disconnect_leaves_other_streams_intact(
    proxy: ProxyHarness, offline_engine: OfflineEngine
) -> None:
    url = proxy.base_url + "/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True}
    ids = proxy.tokenizer.encode(body["prompt"])
    want_ids, _ = offline_engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=24))

    async def both() -> str:
        kept = asyncio.ensure_future(_full_stream(url, body))
        dropped = [_read_then_drop(url, {**LONG, "stream": True}, events=2) for _ in range(3)]
        await asyncio.gather(*dropped)
        return await kept

    assert asyncio.run(both()) == proxy.tokenizer.decode(want_ids)
    proxy.wait_idle(timeout=2.0)


def test_disconnect_detected_on_write_without_handler_cancellation(proxy: ProxyHarness) -> None:
    hooks = type(proxy.hooks)()
    port = proxy.serve(proxy.app(hooks=hooks), handler_cancellation=False)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], **LONG, "stream": True}
    del body["prompt"]
    rid = asyncio.run(_read_then_drop(url, body, events=4))
    proxy.wait_idle(timeout=2.0)
    assert hooks.outcome(rid) == [("cancelled", "disconnect")]


async def _post_with_timeout(url: str, body: dict[str, Any], timeout: float) -> None:
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            await s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout))


def test_disconnect_during_non_streaming_request(proxy: ProxyHarness) -> None:
    before = len(proxy.hooks.events)
    asyncio.run(_post_with_timeout(proxy.base_url + "/v1/completions", LONG, 0.3))
    proxy.wait_idle(timeout=2.0)
    new = proxy.hooks.events[before:]
    assert ("cancelled", "disconnect") in [(e, d) for e, _, d in new]


# -- scripted backends -------------------------------------------------------------------------


class ScriptedBackend:
    """Plays `script(req)`; records which requests started and which streams were closed."""

    def __init__(self, script: Callable[[GenerationRequest], TokenStream]) -> None:
        self.script = script
        self.started: list[str] = []
        self.closed: list[str] = []

    async def generate(self, req: GenerationRequest) -> TokenStream:
        self.started.append(req.request_id)
        try:
            async for chunk in self.script(req):
                yield chunk
        finally:
            self.closed.append(req.request_id)


async def _hang(req: GenerationRequest) -> TokenStream:
    await asyncio.Event().wait()  # queued forever: no first token
    yield TokenChunk([])


async def _overloaded(req: GenerationRequest) -> TokenStream:
    raise BackendError.overloaded("the prefill queue is full", retry_after=2)
    yield TokenChunk([])


def _tokens_then(error: BaseException | None, finish: str | None = None) -> Any:
    async def script(req: GenerationRequest) -> TokenStream:
        yield TokenChunk([72, 101, 108])  # some text first
        if error is not None:
            raise error
        yield TokenChunk([], finish)

    return script


def _serve(proxy: ProxyHarness, backend: ScriptedBackend) -> str:
    app = build_app(backend, proxy.tokenizer, MODEL, 512)
    return f"http://127.0.0.1:{proxy.serve(app)}/v1"


def _wait_for(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token_closes_backend(proxy: ProxyHarness, stream: bool) -> None:
    backend = ScriptedBackend(_hang)
    url = _serve(proxy, backend) + "/completions"
    body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
    asyncio.run(_post_with_timeout(url, body, 0.5))
    assert len(backend.started) == 1
    _wait_for(lambda: backend.closed == backend.started)


async def _raw(url: str, body: dict[str, Any]) -> tuple[int, Any, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, r.headers.copy(), await r.text()


@pytest.mark.parametrize("stream", [True, False])
def test_backend_error_before_stream_is_http_error(proxy: ProxyHarness, stream: bool) -> None:
    backend = ScriptedBackend(_overloaded)
    url = _serve(proxy, backend) + "/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
    status, headers, text = asyncio.run(_raw(url, body))
    assert status == 503 and headers["Retry-After"] == "2"
    assert json.loads(text)["error"]["code"] == "overloaded"
    assert backend.closed == backend.started


def _events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


@pytest.mark.parametrize(
    ("script", "status", "code"),
    [
        (_tokens_then(BackendError.failed("decode node died")), 502, "backend_failure"),
        (_tokens_then(None, finish=None), 502, "backend_failure"),  # ended without finishing
        (_tokens_then(None, finish="abort"), 503, "aborted"),
        (_tokens_then(RuntimeError("bug")), 500, "internal_error"),
    ],
    ids=["backend-error", "no-finish", "abort", "bug"],
)
def test_error_after_stream_started_is_final_sse_event(
    proxy: ProxyHarness, script: Any, status: int, code: str
) -> None:
    backend = ScriptedBackend(script)
    base = _serve(proxy, backend)
    body = {"prompt": "hi", "max_tokens": 8, "stream": True}
    got_status, _, text = asyncio.run(_raw(base + "/completions", body))
    assert got_status == 200
    events = _events(text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == code and error["message"] and "Traceback" not in error["message"]
    assert json.loads(events[0])["choices"][0]["text"]  # the text before the error arrived
    assert backend.closed == backend.started

    # Non-streaming: the same failure is a plain HTTP error.
    got_status, _, text = asyncio.run(_raw(base + "/completions", {**body, "stream": False}))
    assert got_status == status and json.loads(text)["error"]["code"] == code

    # The openai client surfaces the error event as an exception.
    with openai.OpenAI(base_url=base, api_key="x", max_retries=0) as client:
        stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, stream=True)
        with pytest.raises(openai.APIError):
            list(stream)


def test_health_check_hook(proxy: ProxyHarness) -> None:
    async def unhealthy() -> bool:
        return False

    app = build_app(ScriptedBackend(_hang), proxy.tokenizer, MODEL, 512, health_check=unhealthy)
    port = proxy.serve(app)

    async def get() -> int:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
            return r.status

    assert asyncio.run(get()) == 503
