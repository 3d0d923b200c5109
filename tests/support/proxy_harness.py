"""Shared pieces of the proxy tests: a harness around a proxy served from a background event
loop, recording hooks, and the offline reference engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loop import AsyncEngine
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams
from proxy.http.errors import ApiError
from proxy.http.hooks import ProxyHooks
from proxy.http.server import ProxyConfig, build_app, make_runner
from tests.support.engine_backend import EngineBackend

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128
MAX_BODY_BYTES = 64 * 1024
T = TypeVar("T")


class RecordingHooks(ProxyHooks):
    """Keeps every hook call as (event, request_id, detail)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []

    def on_received(self, request_id: str, endpoint: str) -> None:
        self.events.append(("received", request_id, endpoint))

    def on_finished(
        self, request_id: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        self.events.append(("finished", request_id, finish_reason))

    def on_error(self, request_id: str, error: ApiError, stream_started: bool) -> None:
        self.events.append(("error", request_id, (error.status, stream_started)))

    def on_cancelled(self, request_id: str, reason: str) -> None:
        self.events.append(("cancelled", request_id, reason))

    def outcome(self, request_id: str) -> list[tuple[str, Any]]:
        """The terminal events of one request (exactly one is expected)."""
        terminal = ("finished", "error", "cancelled")
        return [(e, d) for e, rid, d in self.events if rid == request_id and e in terminal]


@dataclass
class ProxyHarness:
    loop: asyncio.AbstractEventLoop
    engine: LLMEngine
    front: AsyncEngine
    tokenizer: Tokenizer
    hooks: RecordingHooks
    port: int = 0
    runners: list[web.AppRunner] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run `coro` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application, handler_cancellation: bool = True) -> int:
        """Start `app` on a free loopback port; returns the port. Stopped at session end."""

        async def start() -> int:
            runner = make_runner(app) if handler_cancellation else web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.runners.append(runner)
            return int(runner.addresses[0][1])

        return self.run(start())

    def app(self, **kwargs: Any) -> web.Application:
        """A proxy app over the shared engine (kwargs go to build_app)."""
        kwargs.setdefault("config", ProxyConfig(max_body_bytes=MAX_BODY_BYTES))
        backend = EngineBackend(self.front)
        return build_app(backend, self.tokenizer, MODEL, MAX_MODEL_LEN, **kwargs)

    def free_blocks(self) -> int:
        return int(self.engine.state()["blocks"]["free"])  # type: ignore[index]

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until the engine holds no request and every block is free."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state: Any = self.engine.state()
            requests = state["requests"]
            if state["blocks"]["free"] == NUM_BLOCKS and not any(requests.values()):
                return
            time.sleep(0.01)
        raise AssertionError(f"engine not back at baseline: {self.engine.state()}")


class OfflineEngine:
    """The same model run synchronously (`LLMEngine.generate`): the reference outputs."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)

    def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> tuple[list[int], str]:
        """One prompt run alone: its output token ids and finish reason."""
        (done,) = self.engine.generate([prompt_ids], sampling)
        return done.token_ids, done.finish_reason.value

    def choices(
        self, prompt_ids: list[int], sampling: SamplingParams
    ) -> list[tuple[list[int], str]]:
        """One prompt of `sampling.n` choices run alone: each choice's ids and finish reason."""
        (done,) = self.engine.generate([prompt_ids], sampling)
        more = [(ids, reason.value) for ids, reason in done.more_choices or []]
        return [(done.token_ids, done.finish_reason.value), *more]
