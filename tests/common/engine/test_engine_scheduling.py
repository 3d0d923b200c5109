"""The engine's scheduling through its public surface: add, abort, step.

Every run checks `check_integrity()` after each step and ends with every KV
block free (see EngineDriver in conftest.py). Outputs are greedy on a tiny
random Llama checkpoint, so "the same output" means token-identical.
"""

from __future__ import annotations

import json
import random
import shutil
import time

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine, RequestError
from common.engine.scheduler import KEEPALIVE_S, OutputKind
from common.engine.sequence import FinishReason
from common.wire.sampling_params import SamplingParams

VOCAB = 512


def greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompts(*lens: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def run_alone(engine, driver_cls, prompt, params) -> list[int]:
    driver = driver_cls(engine)
    driver.add("alone", prompt, params)
    return driver.finish()["alone"]


def test_requests_added_mid_run_join_and_match_solo_runs(make_engine, engine_driver):
    engine = make_engine()
    waves = [prompts(5, 40, 17, seed=10), prompts(1, 64, seed=11), prompts(23, 3, 90, seed=12)]
    params = greedy(12)
    driver = engine_driver(engine)
    for wave_no, wave in enumerate(waves):
        for i, p in enumerate(wave):
            driver.add(f"{wave_no}-{i}", p, params)
        running_before = engine.state()["requests"]["running"]
        driver.step()
        # The new wave is admitted at the next step, next to the earlier requests.
        assert engine.state()["requests"]["running"] == running_before + len(wave)
        for _ in range(3):
            driver.step()
    got = driver.finish()
    for wave_no, wave in enumerate(waves):
        for i, p in enumerate(wave):
            assert got[f"{wave_no}-{i}"] == run_alone(engine, engine_driver, p, params)


def test_abort_waiting_and_running_frees_blocks(make_engine, engine_driver):
    engine = make_engine(max_num_seqs=2)
    driver = engine_driver(engine)
    p0, p1, p2, p3 = prompts(30, 20, 10, 5)
    driver.add("r0", p0, greedy(50))
    driver.add("r1", p1, greedy(50))
    driver.add("r2", p2, greedy(50))
    driver.step()
    assert engine.state()["requests"] == {"waiting": 1, "running": 2, "held": 0, "reserved": 0}

    # Abort while waiting: it never ran, so it held no blocks.
    engine.abort_request("r2")
    outs = {o.request_id: o for o in driver.step()}
    assert outs["r2"].finished and outs["r2"].new_token_ids == []
    assert outs["r2"].finish_reason is FinishReason.ABORT
    assert driver.tokens["r2"] == []

    # Abort while running: its blocks go back to the free list.
    for _ in range(3):
        driver.step()
    (seq,) = [s for s in engine.scheduler.running if s.request_id == "r0"]
    owned = list(seq.block_table)
    used = engine.allocator.counts()["used"]
    assert owned and engine.state()["requests"]["running"] == 2
    engine.abort_request("r0")
    outs = {o.request_id: o for o in driver.step()}
    assert outs["r0"] == type(outs["r0"])("r0", [], True, FinishReason.ABORT)
    assert seq.block_table == []
    # r1 ran in the same step and may have taken at most one new block.
    assert engine.allocator.counts()["used"] <= used - len(owned) + 1
    assert engine.state()["requests"] == {"waiting": 0, "running": 1, "held": 0, "reserved": 0}

    # An aborted id is free for reuse; unknown and finished ids are ignored.
    driver.add("r0", p3, greedy(4))
    engine.abort_request("never-added")
    engine.abort_request("r2")
    assert driver.finish()["r0"] == run_alone(engine, engine_driver, p3, greedy(4))
    assert driver.reasons == {
        "r0": FinishReason.LENGTH,
        "r1": FinishReason.LENGTH,
        "r2": FinishReason.ABORT,
    }
    assert len(driver.tokens["r1"]) == 50


def test_abort_before_first_step(make_engine, engine_driver):
    engine = make_engine()
    driver = engine_driver(engine)
    driver.add("a", prompts(12)[0], greedy(5))
    engine.abort_request("a")
    assert [(o.request_id, o.finish_reason) for o in driver.step()] == [("a", FinishReason.ABORT)]
    driver.finish()


def until_preempted(make_engine, engine_driver):
    """(engine, driver, victim): three requests on a pool too small for them, stepped until
    the newest, which had streamed tokens, is preempted and waiting."""
    engine = make_engine(num_blocks=8, block_size=8)
    driver = engine_driver(engine)
    for i, p in enumerate(prompts(20, 20, 20)):
        driver.add(str(i), p, greedy(30))
    while engine.state()["preemptions"] == 0:
        driver.step()
    (victim,) = [s for s in engine.scheduler.waiting if s.num_output_tokens]
    return engine, driver, victim


def test_abort_preempted_request(make_engine, engine_driver):
    engine, driver, victim = until_preempted(make_engine, engine_driver)
    engine.abort_request(victim.request_id)
    driver.finish()
    assert driver.reasons[victim.request_id] is FinishReason.ABORT


def test_a_preempted_request_that_streamed_hears_keepalives_until_it_catches_up(
    make_engine, engine_driver
):
    engine, driver, victim = until_preempted(make_engine, engine_driver)
    sched = engine.scheduler
    later = time.perf_counter() + 60  # past any keepalive the steps so far sent
    got = [(o.request_id, o.kind, o.new_token_ids, o.finished) for o in sched.keepalives(later)]
    assert got == [(victim.request_id, OutputKind.WAITING, [], False)]  # no running one
    assert sched.keepalives(later + KEEPALIVE_S / 2) == []  # one per KEEPALIVE_S at most
    assert len(sched.keepalives(later + KEEPALIVE_S)) == 1
    tokens = driver.finish()
    prompt = prompts(20, 20, 20)[int(victim.request_id)]
    assert tokens[victim.request_id] == run_alone(engine, engine_driver, prompt, greedy(30))
    assert sched.keepalives(later + 10 * KEEPALIVE_S) == []  # nothing waits now


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens(make_engine, engine_driver, max_tokens):
    driver = engine_driver(make_engine())
    for i, p in enumerate(prompts(1, 16, 33)):
        driver.add(str(i), p, greedy(max_tokens))
    got = driver.finish()
    assert all(len(t) == max_tokens for t in got.values())
    assert set(driver.reasons.values()) == {FinishReason.LENGTH}


def first_repeat_free_index(tokens: list[int], start: int) -> int:
    """An index >= start whose token does not occur earlier in `tokens`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids(make_engine, engine_driver):
    engine = make_engine()
    (prompt,) = prompts(9, seed=4)
    full = run_alone(engine, engine_driver, prompt, greedy(16))
    k = first_repeat_free_index(full, 4)
    stop = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(full[k], VOCAB - 1))
    driver = engine_driver(engine)
    driver.add("stop", prompt, stop)
    driver.add("other", prompts(20, seed=5)[0], greedy(16))
    got = driver.finish()
    assert got["stop"] == full[: k + 1]  # the stop token is emitted, then nothing
    assert driver.reasons["stop"] is FinishReason.STOP


def test_eos_stops_unless_ignored(model_dir, tmp_path, engine_driver):
    (prompt,) = prompts(9, seed=4)
    base = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=16))
    full = run_alone(base, engine_driver, prompt, greedy(16))
    k = first_repeat_free_index(full, 3)
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [full[k]]}))
    engine = LLMEngine(EngineConfig(model=str(eos_dir), num_blocks=16))
    driver = engine_driver(engine)
    driver.add("eos", prompt, SamplingParams(temperature=0.0, max_tokens=16))
    driver.add("ignore", prompt, greedy(16))
    got = driver.finish()
    assert got["eos"] == full[: k + 1] and driver.reasons["eos"] is FinishReason.STOP
    assert got["ignore"] == full and driver.reasons["ignore"] is FinishReason.LENGTH


def test_context_length_limits(make_engine, engine_driver):
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestError, match="context is 64"):
        engine.add_request("long", [7] * 64, greedy())
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], greedy())
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("oov", [1, VOCAB], greedy())
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("neg", [1, -1], greedy())
    # A prompt just under the context generates until the context is full.
    driver = engine_driver(engine)
    driver.add("edge", prompts(60)[0], greedy(16))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("edge", [1, 2], greedy())
    assert len(driver.finish()["edge"]) == 4
    assert driver.reasons["edge"] is FinishReason.LENGTH


def test_request_larger_than_kv_pool_is_refused(make_engine):
    engine = make_engine(num_blocks=4, block_size=16)  # 64 tokens of KV
    with pytest.raises(RequestError, match="holds 64"):
        engine.add_request("big", [1] * 60, greedy(10))
    engine.add_request("fits", [1] * 54, greedy(10))


@pytest.mark.parametrize("budget", [1, 7, 16])
@pytest.mark.slow
def test_chunked_long_prompt_gives_same_output(make_engine, engine_driver, budget):
    (long_prompt,) = prompts(200, seed=6)
    reference = run_alone(make_engine(), engine_driver, long_prompt, greedy(8))
    engine = make_engine(max_num_batched_tokens=budget)
    driver = engine_driver(engine)
    driver.add("long", long_prompt, greedy(8))
    driver.add("short", [5, 6, 7], greedy(8))
    steps_to_first_token = 0
    while not driver.tokens["long"]:
        driver.step()
        steps_to_first_token += 1
    assert steps_to_first_token >= 200 // budget
    got = driver.finish()
    assert got["long"] == reference
    assert got["short"] == run_alone(engine, engine_driver, [5, 6, 7], greedy(8))


def test_one_sequence_at_a_time(make_engine, engine_driver):
    engine = make_engine(max_num_seqs=1)
    ps = prompts(3, 30, 8)
    driver = engine_driver(engine)
    for i, p in enumerate(ps):
        driver.add(str(i), p, greedy(5))
    while engine.has_work():
        driver.step()
        assert engine.state()["requests"]["running"] <= 1
    got = driver.finish()
    assert [got[str(i)] for i in range(3)] == [
        run_alone(engine, engine_driver, p, greedy(5)) for p in ps
    ]


@pytest.fixture(scope="module")
def solo_reference(model_dir, engine_driver):
    """(prompt, max_tokens) -> greedy output of the request run alone (cached)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64))
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def get(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = run_alone(engine, engine_driver, prompt, greedy(max_tokens))
        return cache[key]

    return get


@pytest.mark.parametrize("trial", range(8))
def test_random_schedules_match_solo_runs(trial, make_engine, engine_driver, solo_reference):
    """Random pool sizes, budgets, arrivals and aborts: outputs stay those of solo runs."""
    rng = random.Random(trial)
    block_size = rng.choice([1, 2, 4, 8, 16])
    engine = make_engine(
        num_blocks=rng.randint(80 // block_size, 300 // block_size),
        block_size=block_size,
        max_num_batched_tokens=rng.choice([1, 3, 8, 32, 512]),
        max_num_seqs=rng.choice([1, 2, 3, 64]),
    )
    arrivals = {}  # step -> [(id, prompt, max_tokens)]
    for i in range(rng.randint(2, 7)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 70))]
        arrivals.setdefault(rng.randint(0, 12), []).append((str(i), prompt, rng.randint(1, 10)))
    aborts = {rng.randint(0, 25): str(i) for i in range(7) if rng.random() < 0.3}
    driver = engine_driver(engine)
    requests = {}
    step = 0
    while step <= 25 or engine.has_work():
        for rid, prompt, max_tokens in arrivals.get(step, []):
            driver.add(rid, prompt, greedy(max_tokens))
            requests[rid] = (prompt, max_tokens)
        if aborts.get(step) in requests:
            engine.abort_request(aborts[step])
        driver.step()
        step += 1
    got = driver.finish()
    for rid, (prompt, max_tokens) in requests.items():
        expected = solo_reference(prompt, max_tokens)
        if driver.reasons[rid] is FinishReason.ABORT:
            assert got[rid] == expected[: len(got[rid])], rid
        else:
            assert got[rid] == expected, rid


def test_every_step_reports_where_its_time_went(make_engine, engine_driver):
    from common.engine.timing import StepTiming

    engine = make_engine(max_num_batched_tokens=32)
    seen: list[StepTiming] = []
    engine.on_step = seen.append
    driver = engine_driver(engine)
    driver.add("long", prompts(40)[0], greedy(4))  # two chunks of prefill, then decode
    driver.step()
    driver.step()
    driver.add("short", prompts(5, seed=4)[0], greedy(4))
    driver.finish()
    kinds = [t.kind for t in seen]
    assert kinds[0] == "prefill" and "mixed" in kinds and kinds[-1] == "decode"
    first = seen[0]
    assert first.num_prefill_tokens == 32 and first.num_decode == 0
    for t in seen:
        parts = (t.admit_s, t.schedule_s, t.forward_s, t.sample_s, t.output_s)
        assert all(p >= 0 for p in parts) and t.total_s == pytest.approx(sum(parts))
        assert t.forward_s > 0
    # A step that samples nothing (the first chunk of the long prompt) spends no time on it.
    assert first.sample_s == 0 and all(t.sample_s > 0 for t in seen[1:])
