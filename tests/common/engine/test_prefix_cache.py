"""Automatic prefix caching in the engine (issue 14): shared prompt prefixes are computed
once, the output never changes, and the books balance after every step (EngineDriver runs
check_integrity, which checks every reference to every block against its owner)."""

from __future__ import annotations

import torch

from common.engine.block_allocator import BlockState
from common.engine.engine import LLMEngine
from common.wire.sampling_params import SamplingParams

VOCAB = 512


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def run(engine: LLMEngine, driver_cls, reqs: dict[str, list[int]], params) -> tuple[dict, dict]:
    """Run `reqs` together; their tokens and each one's cached prompt tokens."""
    driver = driver_cls(engine)
    cached: dict[str, int] = {}
    for rid, prompt in reqs.items():
        driver.add(rid, prompt, params)
    while engine.has_work():
        for out in driver.step():
            if out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens
    return driver.finish(), cached


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_output(
    make_engine, engine_driver
) -> None:
    prompt = tokens(100, seed=1)
    cold = make_engine(enable_prefix_caching=False)
    (want, _), (again, none) = (
        run(cold, engine_driver, {"a": prompt}, greedy()),
        run(cold, engine_driver, {"b": prompt}, greedy()),
    )
    assert none == {"b": 0} and again["b"] == want["a"]
    engine = make_engine()
    first, cached1 = run(engine, engine_driver, {"a": prompt}, greedy())
    second, cached2 = run(engine, engine_driver, {"b": prompt}, greedy())
    assert cached1 == {"a": 0}
    assert cached2["b"] == 96  # every full block but the one holding the last token
    assert cached2["b"] >= 0.75 * len(prompt)
    assert first["a"] == second["b"] == want["a"]
    cache = engine.state()["prefix_cache"]
    assert cache["hit_tokens"] == 96 and cache["queried_tokens"] == 200
    # Free (at baseline), yet still cached until the space is needed.
    assert engine.allocator.counts()["free"] == 64 and cache["cached_free"] >= 6


def test_shared_prefixes_under_preemption_and_eviction_match_solo_runs(
    make_engine, engine_driver
) -> None:
    """Requests sharing a long system prompt, and generated text that becomes the next
    prompt (a chat turn), on a pool small enough to preempt and evict: every output
    equals the same request run alone without the cache."""
    system = tokens(64, seed=2)
    reqs = {f"r{i}": system + tokens(5 + 7 * i, seed=10 + i) for i in range(6)}
    reference = {
        rid: run(make_engine(enable_prefix_caching=False), engine_driver, {rid: p}, greedy(24))[0][
            rid
        ]
        for rid, p in reqs.items()
    }
    engine = make_engine(num_blocks=14, max_num_seqs=4)
    got, cached = run(engine, engine_driver, reqs, greedy(24))
    assert got == reference
    assert sum(cached.values()) >= 64  # later requests found the system prompt
    assert engine.state()["preemptions"] > 0 and engine.allocator.evictions > 0
    # Turn two: the first answer is in the prompt; its blocks were cached as generated.
    turn2 = reqs["r0"] + reference["r0"] + tokens(9, seed=99)
    solo = run(make_engine(enable_prefix_caching=False), engine_driver, {"t": turn2}, greedy())
    engine2 = make_engine()
    run(engine2, engine_driver, {"r0": reqs["r0"]}, greedy(24))
    again, hit = run(engine2, engine_driver, {"t": turn2}, greedy())
    assert again == solo[0] and hit["t"] >= 64


def test_held_prefix_blocks_are_shared_and_freed_exactly_once(make_engine) -> None:
    """Prefill role: a prompt HELD for transfer shares its prefix with a later request
    running here; both let go, in either order, and every block is free again."""
    engine = make_engine()
    prompt = tokens(70, seed=3)
    engine.add_request("held", prompt, greedy(), hold_kv=True)
    while engine.record("held") is None or engine.record("held").seq is not None:
        engine.step()
        engine.check_integrity()
    held = engine.record("held").blocks
    engine.add_request("runs", prompt + [7, 8], greedy(4))
    engine.step()
    engine.check_integrity()
    shared = [b for b in held if engine.allocator.ref_count(b) == 2]
    assert len(shared) == 4  # the held prompt's full blocks
    assert all(engine.allocator.holders(b) == {BlockState.HELD: 1, BlockState.USED: 1}
               for b in shared)  # fmt: skip
    engine.release_held("held")
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    assert engine.allocator.counts()["free"] == 64
    assert engine.state()["requests"] == {"waiting": 0, "running": 0, "held": 0, "reserved": 0}


def test_caching_off_finds_nothing(make_engine, engine_driver) -> None:
    engine = make_engine(enable_prefix_caching=False)
    prompt = tokens(64, seed=4)
    run(engine, engine_driver, {"a": prompt}, greedy())
    _, cached = run(engine, engine_driver, {"b": prompt}, greedy())
    assert cached == {"b": 0} and engine.allocator.num_cached == 0


def test_the_queue_a_router_reads_counts_only_the_tokens_still_to_compute(
    make_engine, engine_driver
) -> None:
    """`queued_prefill_tokens` leaves out a waiting prompt's prefix that is cached, or that
    a prompt waiting before it will compute (a router must not count a cache hit as work);
    with caching off every prompt token counts."""
    prefix = tokens(64, seed=7)
    engine = make_engine()
    run(engine, engine_driver, {"warm": prefix + tokens(16, seed=8)}, greedy(2))
    driver = engine_driver(engine)
    other = tokens(48, seed=9)
    driver.add("hit", prefix + tokens(20, seed=10), greedy(2))  # 64 cached of 84
    driver.add("new", other + tokens(20, seed=11), greedy(2))  # nothing cached: 68
    driver.add("same", other + tokens(30, seed=12), greedy(2))  # 48 after "new": 30 left
    engine.apply_commands()
    assert engine.scheduler.queued_prefill_tokens() == 20 + 68 + 30
    driver.finish()
    off = make_engine(enable_prefix_caching=False)
    run(off, engine_driver, {"warm": prefix + tokens(16, seed=8)}, greedy(2))
    driver = engine_driver(off)
    driver.add("hit", prefix + tokens(20, seed=10), greedy(2))
    off.apply_commands()
    assert off.scheduler.queued_prefill_tokens() == 84
    driver.finish()
