"""How a streamed response goes out: its head with the first event, one write for each event
after that, and the last event with the usage chunk, `[DONE]` and the body's end in one
write (a send at the proxy and a read at the client each)."""

from __future__ import annotations

import json
from typing import Any

from proxy.http.generation import Generation, write_stream
from proxy.http.hooks import RequestEvents
from proxy.http.prepare import RequestPreparer
from proxy.http.protocol import CompletionRequest
from proxy.http.responses import CompletionFormat, ResponseMeta
from proxy.http.server import SSE_HEADERS, SseResponse
from tests.support.engine_backend import EngineBackend
from tests.support.proxy_harness import MAX_MODEL_LEN, MODEL, ProxyHarness
from tests.support.response_writes import recording_request

END = b"data: [DONE]\n\n\r\n0\r\n\r\n"  # [DONE] as the last chunk, then the body's end


def _stream_writes(proxy: ProxyHarness, **body: Any) -> list[bytes]:
    """The transport writes of a streamed completion of the tiny model, as the proxy's
    handler makes them (aiohttp's own `write_eof` after the handler included)."""

    async def run() -> list[bytes]:
        req = CompletionRequest.model_validate(
            {"model": MODEL, "prompt": "a b c", "stream": True, "ignore_eos": True, **body}
        )
        preparer = RequestPreparer(proxy.tokenizer, MODEL, MAX_MODEL_LEN)
        prep = await preparer.completion("cmpl-writes", req)
        events = RequestEvents(proxy.hooks, prep.request_id)
        gen = Generation(prep, EngineBackend(proxy.front), proxy.tokenizer, events)
        try:
            first = await gen.next_delta()
            request, writes = recording_request()
            resp = SseResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            meta = ResponseMeta(prep.request_id, MODEL, 0, prep.include_usage)
            await write_stream(resp, gen, first, CompletionFormat(meta))
            await resp.write_eof()
        finally:
            await gen.close()
        return writes

    return proxy.run(run())


def _events(write: bytes) -> list[Any]:
    """The JSON payloads of the SSE events in one write ("[DONE]" as a string)."""
    out = []
    for line in write.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[6:]
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def test_the_last_event_usage_and_done_end_the_body_in_one_write(proxy: ProxyHarness) -> None:
    writes = _stream_writes(proxy, max_tokens=6, stream_options={"include_usage": True})
    assert writes[0].startswith(b"HTTP/1.1 200")
    assert len(writes) >= 2
    for write in writes[:-1]:  # the head with the first event, then one event a write
        assert len(_events(write)) == 1
    assert writes[-1].endswith(END)
    *last, usage, done = _events(writes[-1])
    assert [e["choices"][0]["finish_reason"] for e in last] == ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert done == "[DONE]"


def test_a_one_token_stream_is_one_write(proxy: ProxyHarness) -> None:
    (write,) = _stream_writes(proxy, max_tokens=1)
    assert write.startswith(b"HTTP/1.1 200") and write.endswith(END)
    first, done = _events(write)
    assert first["choices"][0]["finish_reason"] == "length" and done == "[DONE]"
