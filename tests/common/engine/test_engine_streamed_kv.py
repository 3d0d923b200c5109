"""Streamed KV (prefill role): full prompt blocks are pinned and reported as each step
computes them, and no end of the request frees a pinned block before the node releases it.

The "transfer" is a plain tensor copy between two engines' caches, group by group, as the
prefill node's streamed write does it across processes.
"""

from __future__ import annotations

from pathlib import Path

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.scheduler import OutputKind, StepOutput
from common.wire.sampling_params import SamplingParams

BS = 8
CHUNK = 12  # tokens a step: a 40-token prompt takes 4 steps, completing 1-2 blocks each


def _engine(model_dir: Path, num_blocks: int = 64) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir), num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=CHUNK
    )
    return LLMEngine(config)


def _step(engine: LLMEngine) -> list[StepOutput]:
    outs = engine.step()
    engine.check_integrity()
    return outs


def _drain(engine: LLMEngine) -> list[StepOutput]:
    outs: list[StepOutput] = []
    while engine.has_work():
        outs += _step(engine)
    return outs


def test_streamed_groups_plus_the_held_rest_decode_as_colocated(tiny_model_dir: Path) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = list(range(7, 47))  # 40 tokens: 5 blocks
    colocated = _engine(tiny_model_dir)
    (want,) = colocated.generate([prompt], sp)

    prefill, decode = _engine(tiny_model_dir), _engine(tiny_model_dir)
    prefill.add_request("s", prompt, sp, hold_kv=True, stream_kv=True)
    dst = decode.reserve("s", len(prompt))
    assert dst is not None and len(dst) == 5
    sent = 0
    held: StepOutput | None = None
    groups = []
    while held is None:
        for out in _step(prefill):
            if out.kind is OutputKind.KV_COMPUTED:
                assert out.computed_blocks and not out.finished
                n = len(out.computed_blocks)
                # A group moves while later chunks compute.
                decode.kv_cache[dst[sent : sent + n]] = prefill.kv_cache[out.computed_blocks]
                sent += n
                groups.append(n)
            elif out.kind is OutputKind.HELD:
                held = out
    assert len(groups) >= 2 and sent == 4  # the last block completes with the last chunk
    assert held.held_blocks is not None and len(held.held_blocks) == 5
    assert prefill.state()["blocks"]["held"] == 5  # pinned blocks are in the held set
    decode.kv_cache[dst[sent:]] = prefill.kv_cache[held.held_blocks[sent:]]
    prefill.release_held("s")
    decode.admit_prefilled("s", prompt, held.new_token_ids[0], sp)
    got = [t for o in _drain(decode) for t in o.new_token_ids]
    _drain(prefill)
    assert [*held.new_token_ids, *got] == want.token_ids
    for engine in (prefill, decode):
        assert engine.state()["blocks"]["free"] == 64


def test_an_abort_mid_prompt_keeps_the_pinned_blocks_until_released(tiny_model_dir: Path) -> None:
    prefill = _engine(tiny_model_dir)
    prefill.add_request("s", list(range(7, 47)), SamplingParams(max_tokens=4), True, True)
    pinned: list[int] = []
    while len(pinned) < 2:
        pinned += [b for o in _step(prefill) for b in o.computed_blocks or []]
    prefill.abort_request("s")
    outs = _step(prefill)
    assert [o.finish_reason.value for o in outs if o.finish_reason] == ["abort"]
    # The sequence's own references are gone; the pinned blocks a write may read are not.
    assert prefill.state()["blocks"]["held"] == len(pinned)
    assert prefill.record("s") is not None
    prefill.abort_request("s")  # a second abort (the stream's close) frees nothing
    _step(prefill)
    assert prefill.state()["blocks"]["held"] == len(pinned)
    prefill.release_held("s")
    _drain(prefill)
    assert prefill.record("s") is None
    assert prefill.state()["blocks"]["free"] == 64


def test_a_streamed_request_finished_at_its_first_token_keeps_its_pins(
    tiny_model_dir: Path,
) -> None:
    prefill = _engine(tiny_model_dir)
    prefill.add_request("s", list(range(7, 47)), SamplingParams(max_tokens=1), True, True)
    outs = _drain(prefill)
    pinned = [b for o in outs for b in o.computed_blocks or []]
    (last,) = [o for o in outs if o.finished]
    assert last.finish_reason is not None and last.held_blocks is None and len(pinned) == 4
    assert prefill.state()["blocks"]["held"] == 4
    prefill.release_held("s")
    _drain(prefill)
    assert prefill.state()["blocks"]["free"] == 64


def test_without_streaming_nothing_is_pinned(tiny_model_dir: Path) -> None:
    prefill = _engine(tiny_model_dir)
    prefill.add_request("h", list(range(7, 47)), SamplingParams(max_tokens=4), hold_kv=True)
    outs = _drain(prefill)
    assert [o.kind for o in outs] == [OutputKind.HELD]
    prefill.release_held("h")
    _drain(prefill)
    assert prefill.state()["blocks"]["free"] == 64


def test_a_preempted_streamed_prompt_keeps_its_pins_and_finishes(tiny_model_dir: Path) -> None:
    """The first prompt's KV stays held (its transfer is slow) while the second computes in
    what is left of a small cache: the second is preempted (its own references freed), its
    pinned blocks stay held, and once the first is released it recomputes (from its pinned,
    cached blocks) to its first token, the books balanced at every step."""
    config = EngineConfig(
        model=str(tiny_model_dir), num_blocks=13, block_size=BS, max_num_batched_tokens=24
    )
    prefill = LLMEngine(config)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    prefill.add_request("first", list(range(10, 70)), sp, True, True)  # 60 tokens: 8 blocks
    prefill.add_request("second", list(range(100, 160)), sp, True, True)
    held: dict[str, int] = {}
    released = False
    for _ in range(100):
        if len(held) == 2:
            break
        for out in _step(prefill):
            if out.kind is OutputKind.HELD:
                held[out.request_id] = len(out.held_blocks or [])
        if prefill.scheduler.num_preemptions and not released:
            pinned = prefill.record("second")
            assert pinned is not None and pinned.pinned  # kept through the preemption
            prefill.release_held("first")
            released = True
    assert held == {"first": 8, "second": 8} and released
    prefill.release_held("second")
    _drain(prefill)
    assert prefill.state()["blocks"]["free"] == 13
