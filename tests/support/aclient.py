"""Async HTTP helpers for end-to-end scenarios: SSE completions that can be dropped at any
moment, node states, Prometheus samples, and greedy request bodies with the offline
engine's text for them."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from multidict import CIMultiDict

from common.text.tokenizer import Tokenizer
from common.tiny.corpus import CORPUS
from common.wire.sampling_params import SamplingParams

TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=5)


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None  # an HTTP error body, or the SSE error event
    events: int = 0  # content events seen
    done: bool = False  # [DONE] seen
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    result: StreamResult | None = None,
) -> StreamResult:
    """POST a streaming completion and read it to its end. `result` fills in as events
    arrive, so a caller that cancels the task can still see how far it got."""
    res = result or StreamResult()
    async with session.post(
        f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as resp:
        res.status = resp.status
        res.headers = CIMultiDict(resp.headers)
        if resp.status != 200:
            res.error = (await resp.json(content_type=None))["error"]
            return res
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :]
            if data == b"[DONE]":
                res.done = True
                break
            event = json.loads(data)
            if "error" in event:
                res.error = event["error"]
                continue
            for choice in event.get("choices", []):
                res.text += choice.get("text", "")
                res.events += 1
                if choice.get("finish_reason") is not None:
                    res.finish_reason = choice["finish_reason"]
    return res


class Request:
    """One streaming completion running as a task; `drop()` closes its connection."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, body: dict[str, Any]):
        self.result = StreamResult()
        self.task = asyncio.ensure_future(stream_completion(session, base_url, body, self.result))

    async def drop(self) -> None:
        """Disconnect, as a client that goes away does."""
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    async def wait(self, timeout: float = 120.0) -> StreamResult:
        return await asyncio.wait_for(self.task, timeout)


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.json(content_type=None)


async def metric(session: aiohttp.ClientSession, base_url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on `base_url`/metrics whose labels include `labels`."""
    async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        text = await r.text()
    return sample_sum(text, name, **labels)


def sample_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def until(
    check: Callable[[], Awaitable[bool]], timeout: float, what: str, interval: float = 0.02
) -> float:
    """Poll `check` until it holds; the seconds it took. AssertionError after `timeout`."""
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(interval)


async def holds(value: bool) -> bool:
    """`value`, as a check `until` can await."""
    return value


def run_with_session(coro_fn: Callable[[aiohttp.ClientSession], Awaitable[Any]]) -> None:
    """Run `coro_fn(session)` on a new event loop with a fresh client session."""

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await coro_fn(session)

    asyncio.run(main())


def corpus_prompt(tokenizer: Tokenizer, n_tokens: int, at: int = 0) -> str:
    """`n_tokens` tokens of the built-in corpus from character `at`, as text."""
    text = tokenizer.decode(tokenizer.encode(CORPUS[at:])[:n_tokens])
    return text.rstrip("\ufffd")


def greedy_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A completion body for exactly `max_tokens` greedy tokens."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def offline_text(tokenizer: Tokenizer, offline_token_ids: Callable, body: dict[str, Any]) -> str:
    """What the offline engine generates for a `greedy_body`."""
    sp = SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], ignore_eos=True)
    return tokenizer.decode(offline_token_ids(tokenizer.encode(body["prompt"]), sp))
