"""The engine's role hooks: a prefill engine holds prompt KV, a decode engine continues it.

The KV moves between the two engines' caches by a plain tensor copy here; the
transfer layer that does it across processes is tested in tests/kv_transfer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.block_allocator import BlockState
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.wire.sampling_params import SamplingParams


def _engine(model_dir: Path, num_blocks: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_blocks=num_blocks, block_size=8))


def _run(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        engine.check_integrity()
    return outs


def _colocated(model_dir: Path, prompts: dict[str, list[int]], sp: SamplingParams) -> dict:
    # Stepped by hand, not LLMEngine.generate: the books are checked after every step.
    engine = _engine(model_dir)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, sp)
    outs = _run(engine)
    assert engine.state()["blocks"]["free"] == 64
    return {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in prompts}


@pytest.mark.parametrize("seed", [None, 7])
def test_prefill_hold_then_decode_elsewhere_matches_colocated(
    tiny_model_dir: Path, seed: int | None
) -> None:
    temp = 0.0 if seed is None else 0.9
    sp = SamplingParams(temperature=temp, seed=seed, max_tokens=12, ignore_eos=True)
    prompts = {"a": list(range(5, 30)), "b": [9, 8, 7], "c": list(range(100, 117))}
    want = _colocated(tiny_model_dir, prompts, sp)

    prefill, decode = _engine(tiny_model_dir), _engine(tiny_model_dir)
    for rid, ids in prompts.items():
        prefill.add_request(rid, ids, sp, hold_kv=True)
    firsts = {rid: outs[-1] for rid, outs in _run(prefill).items()}
    assert prefill.state()["blocks"]["held"] == sum(len(o.held_blocks) for o in firsts.values())
    for rid, out in firsts.items():
        assert out.finished and out.finish_reason is None and len(out.new_token_ids) == 1
        dst = decode.reserve(rid, len(prompts[rid]))
        assert dst is not None and len(dst) == len(out.held_blocks)
        assert all(decode.allocator.state(b) is BlockState.RESERVED for b in dst)
        decode.kv_cache[dst] = prefill.kv_cache[out.held_blocks]  # the "transfer"
        prefill.release_held(rid)
        decode.admit_prefilled(rid, prompts[rid], out.new_token_ids[0], sp)
    got = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in _run(decode).items()}
    _run(prefill)  # applies the releases
    for rid in prompts:
        assert [*firsts[rid].new_token_ids, *got[rid]] == want[rid], rid
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.state()["blocks"]["free"] == 64


def test_prefill_that_finishes_at_first_token_holds_nothing(tiny_model_dir: Path) -> None:
    prefill = _engine(tiny_model_dir)
    prefill.add_request("x", [5, 6, 7], SamplingParams(max_tokens=1), hold_kv=True)
    (out,) = _run(prefill)["x"]
    assert out.finished and out.finish_reason is not None and out.held_blocks is None
    assert prefill.state()["blocks"]["free"] == 64


def test_reservation_refused_when_full_and_freed_on_cancel(tiny_model_dir: Path) -> None:
    decode = _engine(tiny_model_dir, num_blocks=8)
    assert decode.reserve("big", 8 * 8) is None  # would eat the watermark
    blocks = decode.reserve("r", 20)
    assert blocks is not None and len(blocks) == 3
    assert decode.reserve("r", 20) is None  # one reservation per request
    assert decode.state()["blocks"]["reserved"] == 3
    decode.check_integrity()
    decode.free_reserved("r")
    decode.free_reserved("r")  # idempotent
    decode.check_integrity()
    assert decode.state()["blocks"]["free"] == 8


def test_double_abort_in_one_step_is_harmless(tiny_model_dir: Path) -> None:
    # The proxy's cancel and the stream's close both abort: same step, same id.
    engine = _engine(tiny_model_dir)
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("x")
    engine.abort_request("x")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason.value) for o in outs] == [("x", "abort")]
    engine.check_integrity()
    assert engine.state()["blocks"]["free"] == 64


def test_a_decode_engine_reserves_only_what_its_cache_lacks(tiny_model_dir: Path) -> None:
    """Issue 14, delta transfer: the second turn's prompt starts with the first turn's
    prompt and answer, which the decode engine has cached; its reservation shares those
    blocks and only the rest is copied in. The output equals the colocated one."""
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    turn1 = list(range(40, 75))
    answer = _colocated(tiny_model_dir, {"t1": turn1}, sp)["t1"]
    turn2 = turn1 + answer + [3, 1, 4, 1, 5]
    want = _colocated(tiny_model_dir, {"t2": turn2}, sp)["t2"]

    prefill, decode = _engine(tiny_model_dir), _engine(tiny_model_dir)

    def disaggregated(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        prefill.add_request(rid, prompt, sp, hold_kv=True)
        (first,) = _run(prefill)[rid]
        dst = decode.reserve(rid, len(prompt), prompt)
        assert dst is not None and len(dst) == len(first.held_blocks)
        skip = decode.record(rid).num_cached_blocks
        decode.kv_cache[dst[skip:]] = prefill.kv_cache[first.held_blocks[skip:]]  # the delta
        prefill.release_held(rid)
        decode.admit_prefilled(rid, prompt, first.new_token_ids[0], sp)
        out = [t for o in _run(decode)[rid] for t in o.new_token_ids]
        return [first.new_token_ids[0], *out], skip

    got1, skip1 = disaggregated("t1", turn1)
    got2, skip2 = disaggregated("t2", turn2)
    assert got1 == answer and skip1 == 0
    # Turn one's prompt (35 tokens) and answer (10) are 45 tokens: 5 full blocks of 8.
    assert skip2 == 5 and got2 == want
    _run(prefill)
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.state()["blocks"]["free"] == 64


def test_concurrent_reservations_share_a_cached_prefix(tiny_model_dir: Path) -> None:
    """Two requests with the same long prefix reserved at once on a decode engine that has
    the prefix cached: both share its blocks; admitting one (its blocks now USED, the other
    reservation's still RESERVED on the shared ones) must not trip registration, and both
    decode as colocated."""
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    system = list(range(200, 240))
    prompts = {"x": system + [1, 2, 3], "y": system + [4, 5, 6, 7]}
    want = {rid: _colocated(tiny_model_dir, {rid: p}, sp)[rid] for rid, p in prompts.items()}
    prefill, decode = _engine(tiny_model_dir), _engine(tiny_model_dir)
    # The decode engine caches the prefix (a request that ran there).
    decode.add_request("warm", system + [9], sp)
    _run(decode)
    firsts = {}
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, sp, hold_kv=True)
        (firsts[rid],) = _run(prefill)[rid]
    dsts = {rid: decode.reserve(rid, len(p), p) for rid, p in prompts.items()}
    skips = {rid: decode.record(rid).num_cached_blocks for rid in prompts}
    assert skips == {"x": 5, "y": 5}  # 40 system tokens: 5 blocks of 8, shared by both
    decode.check_integrity()
    got = {rid: [firsts[rid].new_token_ids[0]] for rid in prompts}
    for rid, prompt in prompts.items():
        dst, first, skip = dsts[rid], firsts[rid], skips[rid]
        decode.kv_cache[dst[skip:]] = prefill.kv_cache[first.held_blocks[skip:]]
        prefill.release_held(rid)
        decode.admit_prefilled(rid, prompt, first.new_token_ids[0], sp)
        for out in decode.step():  # admitted (and registered) while the other is RESERVED
            got[out.request_id] += out.new_token_ids
        decode.check_integrity()
    for rid, outs in _run(decode).items():
        got[rid] += [t for o in outs for t in o.new_token_ids]
    _run(prefill)
    assert got == want
    for engine in (prefill, decode):
        assert engine.state()["blocks"]["free"] == 64


def test_a_float32_prefill_engine_hands_bfloat16_kv_to_a_bfloat16_decode_engine(
    tiny_model_dir: Path,
) -> None:
    """Each role in its fastest dtype (a CPU without AMX prefills faster in float32 and
    decodes faster in bfloat16): the prefill engine computes in float32 and stores its KV
    in bfloat16, the dtype the decode engine's cache has, so the blocks move as they are."""
    from common.wire.fingerprint import Fingerprint

    def make(dtype: str, kv: str = "auto") -> LLMEngine:
        config = EngineConfig(
            model=str(tiny_model_dir), num_blocks=64, block_size=8, dtype=dtype,
            kv_cache_dtype=kv,
        )  # fmt: skip
        return LLMEngine(config)

    prefill, decode, exact = make("float32", "bfloat16"), make("bfloat16"), make("float32")
    assert prefill.kv_cache.dtype == decode.kv_cache.dtype == torch.bfloat16
    assert prefill.block_bytes * 2 == exact.block_bytes
    fingerprint = Fingerprint.for_kv_cache
    assert fingerprint(prefill.kv_cache, "w") == fingerprint(decode.kv_cache, "w")
    assert fingerprint(prefill.kv_cache, "w") != fingerprint(exact.kv_cache, "w")

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(5, 40))  # 35 tokens: 5 blocks of 8, the last partly filled
    for engine in (prefill, exact):
        engine.add_request("r", prompt, sp, hold_kv=True)
    (first,) = _run(prefill)["r"]
    (want,) = _run(exact)["r"]
    # The first layer's KV is the float32 model's rounded to bfloat16 (no attention before
    # it read a rounded cache); later layers' stay near it.
    got_kv = prefill.kv_cache[first.held_blocks].float()
    want_kv = exact.kv_cache[want.held_blocks]
    assert torch.equal(got_kv[:, 0], want_kv[:, 0].to(torch.bfloat16).float())
    assert not torch.equal(got_kv[:, 0], want_kv[:, 0])  # (rounded: not the float32 bytes)
    assert torch.allclose(got_kv, want_kv, rtol=0.05, atol=0.05)

    dst = decode.reserve("r", len(prompt))
    assert dst is not None and len(dst) == len(first.held_blocks)
    decode.kv_cache[dst] = prefill.kv_cache[first.held_blocks]  # the "transfer", as is
    prefill.release_held("r")
    exact.release_held("r")
    decode.admit_prefilled("r", prompt, first.new_token_ids[0], sp)
    out = [t for o in _run(decode)["r"] for t in o.new_token_ids]
    assert len(out) == 11
    for engine in (prefill, decode, exact):
        _run(engine)
        engine.check_integrity()
        assert engine.state()["blocks"]["free"] == 64


def test_another_kv_dtype_than_the_model_needs_the_torch_kernels(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="float16")
    config = EngineConfig(
        model=str(tiny_model_dir), num_blocks=8, dtype="float32", kv_cache_dtype="bfloat16",
        kernel_backend="triton",
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs the torch kernels"):
        LLMEngine(config)
