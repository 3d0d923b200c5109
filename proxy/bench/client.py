"""bench-serve's client side of one request: POST, read the SSE stream, time it.

What is timed (client clock, `time.perf_counter`, from just before the POST):

- TTFT: until the first chunk carrying non-empty text (a chat stream's empty role chunk
  does not count);
- ITL: the gaps between consecutive chunks carrying text (one per chunk, not normalised
  when a chunk carries several tokens);
- E2EL: until `data: [DONE]`.

Output tokens come from the usage chunk (`stream_options.include_usage`); a server that sends
none is counted one token per text chunk, and the result says so. A request completes only if
the status is 200, no error event arrives and the stream ends with `[DONE]`; anything else
(connection refused, timeout, HTTP error, error event, truncated stream) is a failure with a
short `error` kind for the summary and a `detail` message.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MAX_ERROR_BODY = 4096  # bytes of a non-200 body kept for the message
DONE = "[DONE]"


@dataclass
class RequestResult:
    ok: bool
    start_s: float  # when it was sent, seconds since the run started
    e2el_s: float
    requested_output_tokens: int
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 if not reported)
    usage_reported: bool = False
    text: str = ""  # the generated text
    error: str | None = None  # a short kind, for grouping ("HTTP 503", "timeout", ...)
    detail: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(e2el - ttft) / (output_tokens - 1): the mean time per token after the first."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


class StreamError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class StreamTimer:
    """Consumes one response's SSE data payloads with their arrival times (seconds since the
    request was sent). Network-free, so the timing rules are testable on their own."""

    def __init__(self) -> None:
        self.first_text_s: float | None = None
        self.last_text_s: float | None = None
        self.itl_s: list[float] = []
        self.text_chunks = 0
        self.parts: list[str] = []  # the streamed text (a conversation's next turn needs it)
        self.usage: dict[str, Any] | None = None
        self.done_s: float | None = None

    def feed(self, payload: str, t: float) -> None:
        """One `data:` payload; raises StreamError on an error event or bad JSON."""
        if payload == DONE:
            self.done_s = t
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            raise StreamError("bad event", payload[:200]) from None
        if not isinstance(event, dict):
            raise StreamError("bad event", payload[:200])
        if "error" in event:
            raise StreamError("stream error", _error_text(event))
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            text = _choice_text(choice)
            if text:
                self.parts.append(text)
                self._text(t)

    def _text(self, t: float) -> None:
        if self.first_text_s is None:
            self.first_text_s = t
        else:
            assert self.last_text_s is not None
            self.itl_s.append(t - self.last_text_s)
        self.last_text_s = t
        self.text_chunks += 1


def _choice_text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return ""
    text = choice.get("text")  # completions
    if text is None:
        text = (choice.get("delta") or {}).get("content")  # chat
    return text if isinstance(text, str) else ""


def _error_text(body: Any) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = err.get("code") or err.get("type") or ""
        return f"{code}: {err.get('message', '')}".strip(": ")
    return str(err if err is not None else body)[:300]


def parse_sse_line(raw: bytes) -> str | None:
    """The payload of a `data:` line, or None for blank lines, comments and other fields."""
    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    return line[5:].removeprefix(" ")


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    run_start: float,
) -> RequestResult:
    """One streaming request; never raises for a server or network failure (the result says
    it failed). The session's timeout bounds the whole request."""
    t0 = time.perf_counter()
    result = RequestResult(
        ok=False, start_s=t0 - run_start, e2el_s=0.0, requested_output_tokens=body["max_tokens"]
    )
    timer = StreamTimer()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.content.read(MAX_ERROR_BODY)).decode(errors="replace")
                raise StreamError(f"HTTP {resp.status}", _http_error(text))
            async for raw in resp.content:
                payload = parse_sse_line(raw)
                if payload is not None:
                    timer.feed(payload, time.perf_counter() - t0)
                    if timer.done_s is not None:
                        break
        if timer.done_s is None:
            raise StreamError("truncated stream", "the stream ended without [DONE]")
    except StreamError as e:
        result.error, result.detail = e.kind, e.detail
    except asyncio.TimeoutError:
        result.error, result.detail = "timeout", "no complete response within the request timeout"
    except aiohttp.ClientConnectorError as e:
        result.error, result.detail = "connect error", str(e)
    except aiohttp.ClientError as e:
        result.error, result.detail = type(e).__name__, str(e)
    result.e2el_s = time.perf_counter() - t0
    _fill(result, timer)
    return result


def _http_error(text: str) -> str:
    try:
        return _error_text(json.loads(text))
    except json.JSONDecodeError:
        return text[:300]


def _fill(result: RequestResult, timer: StreamTimer) -> None:
    result.ttft_s = timer.first_text_s
    result.itl_s = timer.itl_s
    result.text = "".join(timer.parts)
    usage = timer.usage or {}
    completion = usage.get("completion_tokens")
    result.usage_reported = isinstance(completion, int)
    result.output_tokens = completion if isinstance(completion, int) else timer.text_chunks
    prompt = usage.get("prompt_tokens")
    result.prompt_tokens = prompt if isinstance(prompt, int) else None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    result.cached_tokens = cached if isinstance(cached, int) else 0
    if result.error is None:
        if timer.done_s is not None:
            result.e2el_s = timer.done_s
        if result.ttft_s is None:  # [DONE] without any text: no TTFT to report
            result.error, result.detail = "no output", "the stream carried no text"
        else:
            result.ok = True
