"""The slowest step a node reports (`step_time_max_s` in its state), which sets how long a
proxy waits on a silent stream before it calls it stalled (4x): remembered for minutes, not
for the last few dozen steps, and never below a full prefill chunk at the measured rate."""

from __future__ import annotations

from collections.abc import Callable

from common.engine.engine import LLMEngine
from common.engine.timing import SlowestRecent, step_time_bound
from common.wire.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_step_is_remembered_for_the_window_however_many_fast_steps_follow() -> None:
    clock = Clock()
    slowest = SlowestRecent(60.0, clock)
    assert slowest.max() is None
    slowest.add(7.0)  # a long prefill chunk
    for _ in range(1000):  # a long run of decode steps
        clock.now += 0.05
        slowest.add(0.1)
    assert slowest.max() == 7.0  # 50 s later, 1,000 steps later
    clock.now += 10.1
    assert slowest.max() == 0.1  # out of the window: the fast steps in it remain
    clock.now += 61
    assert slowest.max() is None


def test_the_maximum_is_the_slowest_step_still_in_the_window() -> None:
    clock = Clock()
    slowest = SlowestRecent(10.0, clock)
    for seconds in (3.0, 1.0, 2.0, 0.5):
        slowest.add(seconds)
        clock.now += 4
    # added at t+0 (3.0), t+4 (1.0), t+8 (2.0), t+12 (0.5); now t+16
    assert slowest.max() == 2.0
    clock.now += 3  # t+19: only 0.5 (t+12) is within 10 s
    assert slowest.max() == 0.5
    slowest.add(0.5)  # a tie replaces the older one: it expires later
    clock.now += 8  # t+27: the first 0.5 is gone, the second (t+19) is not
    assert slowest.max() == 0.5


def test_a_full_prefill_chunk_at_the_measured_rate_is_a_floor_once_a_rate_is_known() -> None:
    assert step_time_bound(None, 512, None) is None  # nothing timed, no rate
    assert step_time_bound(0.2, 512, None) == 0.2  # no rate (a decode-only node)
    assert step_time_bound(None, 512, 64.0) == 8.0  # every step aged out: the chunk
    assert step_time_bound(0.2, 512, 64.0) == 8.0
    assert step_time_bound(30.0, 512, 64.0) == 30.0  # a step slower than a chunk


def test_the_engine_publishes_it_after_a_prefill(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([list(range(5, 45))], params)  # a 40-token prefill: a rate is measured
    rate = engine.prefill_tokens_per_s
    assert rate is not None
    published = engine.state()["step_time_max_s"]
    assert isinstance(published, float)
    assert published >= 64 / rate and published >= (engine._slowest_step.max() or 0.0)


def test_before_any_prefill_the_warm_up_rate_bounds_a_full_chunk(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A node's first long prompt: nothing real has been timed yet, so the bound comes from
    the warm-up's prefill, which is not a rate a router may plan with."""
    engine = make_engine(max_num_batched_tokens=64)
    engine.warm_up()
    warm = engine.warm_up_prefill_tokens_per_s
    assert warm is not None and engine.prefill_tokens_per_s is None
    published = engine.state()["step_time_max_s"]
    assert isinstance(published, float) and published >= 64 / warm
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([list(range(5, 45))], params)  # a real prefill: its rate takes over
    rate = engine.prefill_tokens_per_s
    assert rate is not None
    assert engine.state()["step_time_max_s"] == step_time_bound(
        engine._slowest_step.max(), 64, rate
    )
