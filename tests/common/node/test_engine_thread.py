"""A node's engine is built, warmed up and stepped on one thread.

GNU OpenMP (torch's CPU thread pool) gives each thread that starts a parallel region a
team of workers of its own, and a second team slows the first one's every region. A node
that loaded and warmed its model on a worker thread and stepped it on the engine thread
decoded at 55-60% speed with 2 torch threads (SmolLM2, bfloat16, batch 8: 72 ms a decode
step served against 42 ms offline); with one thread there is no team, so nothing showed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.node.server import NodeConfig, NodeRuntime
from common.wire.sampling_params import SamplingParams


def test_the_engine_is_built_warmed_and_stepped_on_the_engine_thread(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: dict[str, set[int]] = {}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def called(*args: Any, **kwargs: Any) -> Any:
            threads.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)

        return called

    for name in ("__init__", "warm_up", "step"):
        monkeypatch.setattr(LLMEngine, name, spy(name, getattr(LLMEngine, name)))

    async def body() -> None:
        engine = EngineConfig(model=str(tiny_model_dir), num_blocks=64, threads=1)
        runtime = await NodeRuntime.start(NodeConfig(role="both", engine=engine))
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            got = [out async for out in runtime.front.generate("r", [5, 6, 7], sp)]
            assert sum(len(out.new_token_ids) for out in got) == 4
        finally:
            await runtime.front.stop()

    asyncio.run(body())
    assert set(threads) == {"__init__", "warm_up", "step"}
    used = set().union(*threads.values())
    assert len(used) == 1, threads
    assert threading.get_ident() not in used  # and off the event loop's thread
