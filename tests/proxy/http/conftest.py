"""A real proxy on 127.0.0.1 over the in-process engine, served from a background event loop.

The session's `proxy` fixture runs one `LLMEngine` (tiny model, 128 blocks) behind
`EngineBackend` and `build_app`; tests talk to it over HTTP from the test thread (the openai
client, or aiohttp in `asyncio.run`). `proxy.serve(app)` starts more apps on the same loop
(fake backends, other settings).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loop import AsyncEngine
from common.text.tokenizer import Tokenizer
from tests.support.proxy_harness import (
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    OfflineEngine,
    ProxyHarness,
    RecordingHooks,
)


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_model_dir), num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, threads=1
    )


@pytest.fixture(scope="session")
def proxy(engine_config: EngineConfig, tiny_tokenizer: Tokenizer) -> Iterator[ProxyHarness]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="proxy-loop", daemon=True)
    thread.start()
    engine = LLMEngine(engine_config)
    front = AsyncEngine(engine, loop)
    harness = ProxyHarness(loop, engine, front, tiny_tokenizer, RecordingHooks())
    harness.run(front.start())
    harness.port = harness.serve(harness.app(hooks=harness.hooks))
    try:
        yield harness
    finally:
        for runner in reversed(harness.runners):
            harness.run(runner.cleanup())
        harness.run(front.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    engine.check_integrity()


@pytest.fixture(scope="session")
def offline_engine(engine_config: EngineConfig) -> OfflineEngine:
    """A second engine of the same model, run synchronously: the reference outputs
    (`offline_engine.generate(ids, sampling)` -> token ids and finish reason)."""
    return OfflineEngine(engine_config)
