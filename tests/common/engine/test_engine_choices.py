"""n > 1 choices: the prompt is prefilled once (and, disaggregated, its KV moved once);
the engine that decodes forks the sequence n ways, the forks sharing the prompt's blocks
and each copying the block it writes next. Choices are reproducible per seed, each the
draw its own parameters would make alone, and free every block when they end or abort."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loop import AsyncEngine
from common.wire.sampling_params import SamplingParams

PROMPT = list(range(5, 40))  # 35 tokens: four full blocks of 8 and a partial one


def _engine(model_dir: Path, num_blocks: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_blocks=num_blocks, block_size=8))


def _choices(c) -> list[list[int]]:  # noqa: ANN001 - a Completion
    return [c.token_ids, *[t for t, _ in c.more_choices or []]]


@pytest.mark.parametrize("n", [2, 4])
def test_choices_are_reproducible_independent_and_each_its_own_draw(
    tiny_model_dir: Path, n: int
) -> None:
    engine = _engine(tiny_model_dir)
    sp = SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, n=n)
    (a,) = engine.generate([PROMPT], sp)
    (b,) = engine.generate([PROMPT], sp)
    assert _choices(a) == _choices(b) and len(_choices(a)) == n
    assert len({tuple(c) for c in _choices(a)}) == n  # independent draws
    alone = [engine.generate([PROMPT], sp.for_choice(j))[0].token_ids for j in range(n)]
    assert _choices(a) == alone
    engine.check_integrity()
    assert engine.state()["blocks"]["free"] == 64


def test_a_decode_engine_forks_what_it_received_once(tiny_model_dir: Path) -> None:
    """Disaggregated: the prefill engine samples choice 0's first token and holds one copy
    of the prompt's KV; the decode engine admits it and forks: every choice equals the
    colocated engine's."""
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, n=3)
    (want,) = _engine(tiny_model_dir).generate([PROMPT], sp)
    prefill, decode = _engine(tiny_model_dir), _engine(tiny_model_dir)
    prefill.add_request("r", PROMPT, sp, hold_kv=True)
    first = None
    while prefill.has_work():
        for out in prefill.step():
            first = out
    assert first is not None and first.held_blocks is not None
    dst = decode.reserve("r", len(PROMPT))
    assert dst is not None
    decode.kv_cache[dst] = prefill.kv_cache[first.held_blocks]  # the one "transfer"
    prefill.release_held("r")
    prefill.step()
    decode.admit_prefilled("r", PROMPT, first.new_token_ids[0], sp)
    got: dict[int, list[int]] = {0: [first.new_token_ids[0]], 1: [], 2: []}
    while decode.has_work():
        for out in decode.step():
            assert (out.route or out.request_id) == "r"
            got[out.choice] += out.new_token_ids
        decode.check_integrity()
    assert [got[j] for j in range(3)] == _choices(want)
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.state()["blocks"]["free"] == 64


def test_cancelling_n4_mid_stream_frees_every_block_once(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)

    async def main() -> None:
        front = AsyncEngine(engine, asyncio.get_running_loop())
        await front.start()
        try:
            sp = SamplingParams(temperature=0.9, seed=1, max_tokens=200, ignore_eos=True, n=4)
            stream = front.generate("r", PROMPT, sp)
            seen: set[int] = set()
            async for out in stream:
                seen.add(out.choice)
                if len(seen) == 4:
                    break
            await stream.aclose()  # aborts every choice
            for _ in range(200):
                if engine.state()["blocks"]["free"] == 64 and not engine.state()["requests"]:
                    break
                await asyncio.sleep(0.01)
            assert engine.state()["blocks"]["free"] == 64, engine.state()
            assert await front.call(engine.check_integrity_when_idle)
        finally:
            await front.stop()

    asyncio.run(main())
