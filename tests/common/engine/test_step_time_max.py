"""The slowest step a node reports (`step_time_max_s` in its state), which sets how long a
proxy waits on a silent stream before it calls it stalled (4x): remembered for minutes, not
for the last few dozen steps, and never below a full prefill chunk at the measured rate."""

from __future__ import annotations

from collections.abc import Callable

from common.engine.engine import STEP_MEMORY_S, LLMEngine
from common.engine.timing import SlowestRecent
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


def test_a_node_that_has_prefilled_reports_at_least_a_full_chunk_at_its_prefill_rate(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine(max_num_batched_tokens=64)
    assert engine.step_time_max_s() is None  # no step yet
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([list(range(5, 45))], params)  # a 40-token prefill: a rate is measured
    rate = engine.prefill_tokens_per_s
    assert rate is not None
    assert engine.state()["step_time_max_s"] == engine.step_time_max_s()  # what /state says
    engine._slowest_step = SlowestRecent(STEP_MEMORY_S)  # as if every step had aged out
    assert engine.step_time_max_s() == 64 / rate
    engine._slowest_step.add(1e6)  # one slower than a chunk
    assert engine.step_time_max_s() == 1e6
