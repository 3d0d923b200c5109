"""n > 1 choices: the prompt is prefilled once (and, disaggregated, its KV moved once);
the engine that decodes forks the sequence n ways, the forks sharing the prompt's blocks
and each copying the block it writes next. Choices are reproducible per seed, each the
draw its own parameters would make alone, and free every block when they end or abort."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
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


def _disaggregated(
    model_dir: Path, sp: SamplingParams, while_landing: Callable[[LLMEngine], None] | None = None
) -> list[tuple[list[int], str]]:
    """Prefill on one engine (it samples choice 0's first token and holds one copy of the
    prompt's KV), decode on another (it admits that and forks): each choice's tokens and
    finish reason. `while_landing(decode)` runs between the reservation and the admission."""
    prefill, decode = _engine(model_dir), _engine(model_dir)
    prefill.add_request("r", PROMPT, sp, hold_kv=True)
    first = None
    while prefill.has_work():
        for out in prefill.step():
            first = out
    assert first is not None and first.held_blocks is not None  # held, even if it stops
    dst = decode.reserve("r", len(PROMPT), choices=sp.n)
    assert dst is not None
    if while_landing is not None:
        while_landing(decode)
    decode.kv_cache[dst] = prefill.kv_cache[first.held_blocks]  # the one "transfer"
    prefill.release_held("r")
    prefill.step()
    decode.admit_prefilled("r", PROMPT, first.new_token_ids[0], sp)
    got: dict[int, list[int]] = {j: [] for j in range(sp.n)}
    got[0].append(first.new_token_ids[0])
    reasons: dict[int, str] = {}
    while decode.has_work():
        for out in decode.step():
            assert (out.route or out.request_id) == "r" and out.choice not in reasons
            got[out.choice] += out.new_token_ids
            if out.finished:
                assert out.finish_reason is not None
                reasons[out.choice] = out.finish_reason.wire_name
        decode.check_integrity()
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.state()["blocks"]["free"] == 64
    return [(got[j], reasons[j]) for j in range(sp.n)]


def _offline(model_dir: Path, sp: SamplingParams) -> list[tuple[list[int], str]]:
    (c,) = _engine(model_dir).generate([PROMPT], sp)
    return [(t, r.wire_name) for t, r in [(c.token_ids, c.finish_reason), *(c.more_choices or [])]]


def test_a_decode_engine_forks_what_it_received_once(tiny_model_dir: Path) -> None:
    """Disaggregated, every choice equals the colocated engine's."""
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, n=3)
    assert _disaggregated(tiny_model_dir, sp) == _offline(tiny_model_dir, sp)


@pytest.mark.parametrize("stop", ["length", "stop"])
def test_choice_0_ending_at_its_first_token_still_forks(tiny_model_dir: Path, stop: str) -> None:
    """The prefill node holds the KV of several choices whatever choice 0's first token is;
    the decode node ends choice 0 at admission and decodes the others."""
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True, n=3)
    (probe,) = _engine(tiny_model_dir).generate([PROMPT], sp)
    if stop == "length":
        sp = sp.model_copy(update={"max_tokens": 1})
    else:  # choice 0's first token is a stop token for this request
        sp = sp.model_copy(update={"stop_token_ids": [probe.token_ids[0]]})
    got = _disaggregated(tiny_model_dir, sp)
    assert got == _offline(tiny_model_dir, sp)
    assert got[0] == ([probe.token_ids[0]], stop)
    assert all(len(t) >= 1 for t, _ in got[1:])


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


@pytest.mark.parametrize("room", ["seqs", "blocks"])
def test_forks_without_room_wait_and_prefill_themselves(tiny_model_dir: Path, room: str) -> None:
    """A fork that finds the batch full (max_num_seqs) or no free block waits, and
    prefills its prompt itself once there is room: the same draw as with room."""
    sp = SamplingParams(temperature=0.9, seed=2, max_tokens=6, ignore_eos=True, n=4)
    want = _offline(tiny_model_dir, sp)
    if room == "seqs":
        config = EngineConfig(
            model=str(tiny_model_dir), num_blocks=64, block_size=8, max_num_seqs=2
        )
    else:  # the prompt's 5 blocks, one copy and the watermark: the others wait
        config = EngineConfig(model=str(tiny_model_dir), num_blocks=8, block_size=8)
    engine = LLMEngine(config)
    (c,) = engine.generate([PROMPT], sp)
    got = [(t, r.wire_name) for t, r in [(c.token_ids, c.finish_reason), *(c.more_choices or [])]]
    assert got == want
    engine.check_integrity()
    assert engine.state()["blocks"]["free"] == config.num_blocks


@pytest.mark.parametrize("ended", [0, 2])
def test_one_choice_aborted_alone_the_others_go_on(tiny_model_dir: Path, ended: int) -> None:
    """A choice the client is done with (a stop string) is aborted alone: it ends with
    ABORT and its blocks go back, the other choices are the draws they were."""
    sp = SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, n=3)
    want = _offline(tiny_model_dir, sp)
    engine = _engine(tiny_model_dir)
    engine.abort_request("r", 1)  # before the fork: ignored
    engine.add_request("r", PROMPT, sp)
    got: dict[int, list[int]] = {j: [] for j in range(3)}
    reasons: dict[int, str] = {}
    while engine.has_work():
        for out in engine.step():
            got[out.choice] += out.new_token_ids
            if out.finished:
                assert out.finish_reason is not None
                reasons[out.choice] = out.finish_reason.wire_name
            if len(got[ended]) == 3 and ended not in reasons:
                engine.abort_request("r", ended)
        engine.check_integrity()
    assert reasons[ended] == "abort" and got[ended] == want[ended][0][:3]
    for j in {0, 1, 2} - {ended}:
        assert (got[j], reasons[j]) == want[j]
    assert engine.state()["blocks"]["free"] == 64
    assert not any(engine.state()["requests"].values())


def test_a_choice_aborted_before_the_fork_ends_at_it(tiny_model_dir: Path) -> None:
    """A decode node told to end a choice while the request's KV is still landing (the
    client met a stop string in choice 0's first token, which came from the prefill node)
    ends that choice when it forks, not after max_tokens; the others are unchanged."""
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, n=3)
    want = _offline(tiny_model_dir, sp)
    got = _disaggregated(tiny_model_dir, sp, lambda decode: decode.abort_request("r", 0))
    assert got[0] == (want[0][0][:1], "abort")
    assert got[1:] == want[1:]
