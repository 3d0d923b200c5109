"""`AsyncEngine`: the engine on its own thread, streamed to asyncio consumers."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from common.engine.checks import RequestError
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loop import AsyncEngine, EngineThread
from common.wire.sampling_params import SamplingParams, StructuredOutput


def test_async_engine_streams_and_aborts(tiny_model_dir: Path) -> None:
    async def run() -> None:
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
        front = AsyncEngine(engine, asyncio.get_running_loop())
        await front.start()
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

            async def collect(rid: str) -> list[int]:
                ids: list[int] = []
                async for out in front.generate(rid, [5, 6, 7, 8], sp):
                    ids += out.new_token_ids
                return ids

            a, b = await asyncio.gather(collect("a"), collect("b"))
            assert a == b and len(a) == 10

            # A consumer that stops early aborts its request; blocks come back.
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            gen = front.generate("c", [5, 6, 7], long)
            await gen.__anext__()
            await gen.aclose()
            for _ in range(200):
                if engine.state()["blocks"]["free"] == 64 and not engine.has_work():
                    break
                await asyncio.sleep(0.01)
            assert engine.state()["blocks"]["free"] == 64
        finally:
            await front.stop()
        engine.check_integrity()

    asyncio.run(run())


def test_a_constraint_compiles_off_the_event_loop(tiny_model_dir: Path) -> None:
    """A new grammar (and xgrammar's first load) compiles on a worker thread, so the loop
    that relays every stream of the node never waits for it; one that does not compile is
    refused there, before the request reaches the engine."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    threads: list[int] = []
    compile_constraint = engine.compile_constraint

    def spy(spec: StructuredOutput) -> None:
        threads.append(threading.get_ident())
        compile_constraint(spec)

    engine.compile_constraint = spy  # type: ignore[method-assign]

    async def run() -> None:
        front = AsyncEngine(engine, asyncio.get_running_loop())
        schema = StructuredOutput(kind="regex", spec="(yes|no)")
        await front.compile_constraint(SamplingParams(max_tokens=3, structured=schema))
        await front.compile_constraint(SamplingParams(max_tokens=3))  # unconstrained: nothing
        bad = StructuredOutput(kind="regex", spec="(unclosed")
        with pytest.raises(RequestError):
            await front.compile_constraint(SamplingParams(max_tokens=3, structured=bad))

    asyncio.run(run())
    assert len(threads) == 2 and threading.get_ident() not in threads


def test_an_engine_thread_reports_a_failed_build_and_stops_before_stepping() -> None:
    """`EngineThread.run` (a node builds and warms its engine there): the call's exception
    comes back through its future; stopped before `start`, the thread ends."""
    thread = EngineThread()
    assert thread.run(lambda: 6 * 7).result(10) == 42
    with pytest.raises(ZeroDivisionError):
        thread.run(lambda: 1 / 0).result(10)
    thread.stop(10)
    assert not thread._thread.is_alive() and thread.error is None
    EngineThread().stop(1)  # never started: nothing to end
