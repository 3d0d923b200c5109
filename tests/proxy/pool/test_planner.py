"""The role planner's decision rule, fed synthetic samples of a load that shifts."""

from __future__ import annotations

import pytest

from proxy.pool.node_state import Role
from proxy.pool.planner import Decision, Planner, PlannerConfig, PoolSample

CONFIG = PlannerConfig(window_s=10.0, interval_s=60.0, margin_s=0.5, sample_s=1.0)


def run(
    planner: Planner,
    start: float,
    seconds: int,
    prefill_wait: float,
    decode_wait: float,
    pools: list[int],
) -> list[tuple[float, Decision]]:
    """One sample a second; `pools` ([prefill, decode] node counts) follows each move."""
    moves = []
    for k in range(seconds):
        t = start + k
        decision = planner.observe(PoolSample(t, prefill_wait, decode_wait, pools[0], pools[1]))
        if decision is not None:
            moves.append((t, decision))
            pools[0 if decision.source is Role.PREFILL else 1] -= 1
            pools[0 if decision.target is Role.PREFILL else 1] += 1
    return moves


def test_a_shifting_load_moves_one_node_each_way_at_a_bounded_rate() -> None:
    planner = Planner(CONFIG)
    pools = [1, 3]  # 1P3D
    # Balanced: nothing moves.
    assert run(planner, 0, 30, 0.2, 0.1, pools) == []
    # A burst of long prompts: the prefill queue waits 3 s, decode has slack. One decode
    # node moves once the imbalance lasted the window; the next waits for the interval.
    moves = run(planner, 30, 100, 3.0, 0.0, pools)
    assert [(t, d.source, d.target) for t, d in moves] == [
        (40, Role.DECODE, Role.PREFILL),
        (100, Role.DECODE, Role.PREFILL),
    ]
    assert "prefill queue wait 3.00 s vs decode 0.00 s" in moves[0][1].reason
    assert pools == [3, 1]
    # The last decode node never leaves, however long prefill keeps waiting.
    assert run(planner, 130, 200, 3.0, 0.0, pools) == []
    # The load shifts to long outputs: prefilled requests wait for decode.
    moves = run(planner, 330, 30, 0.0, 2.0, pools)
    assert [(t, d.source, d.target) for t, d in moves] == [(340, Role.PREFILL, Role.DECODE)]
    assert pools == [2, 2]


def test_an_imbalance_that_is_not_sustained_moves_nothing() -> None:
    planner = Planner(CONFIG)
    pools = [1, 3]
    for start in range(0, 200, 10):  # 9 s leaning to prefill, then one balanced sample
        assert run(planner, start, 9, 3.0, 0.0, pools) == []
        assert run(planner, start + 9, 1, 0.1, 0.0, pools) == []
    # A lean that flips direction restarts the window too.
    assert run(planner, 300, 5, 3.0, 0.0, pools) == []
    assert run(planner, 305, 5, 0.0, 3.0, pools) == []
    assert run(planner, 310, 5, 3.0, 0.0, pools) == []
    assert pools == [1, 3]


def test_a_difference_within_the_margin_is_balance() -> None:
    planner = Planner(CONFIG)
    assert run(planner, 0, 100, 0.9, 0.5, [1, 3]) == []  # 0.4 s apart: within 0.5 s


@pytest.mark.parametrize(
    ("window", "interval", "margin", "sample"), [(-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, 1, 0)]
)
def test_bad_planner_settings_are_refused(
    window: float, interval: float, margin: float, sample: float
) -> None:
    with pytest.raises(ValueError):
        PlannerConfig(window, interval, margin, sample)
