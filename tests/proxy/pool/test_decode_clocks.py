"""The decode streams' slack against the TPOT objective (decode_clocks.py), on a made-up
clock."""

from __future__ import annotations

import pytest

from proxy.pool.decode_clocks import GAPS, DecodeClocks

URL = "http://d"


def test_slack_is_the_objective_left_after_the_time_used_and_the_steps_to_come() -> None:
    clocks = DecodeClocks()
    assert clocks.slack_s(URL, 0.1, now=0.0) is None  # no stream there
    # 11 tokens, so 10 gaps within 100 ms each: 1 s in all from the first token.
    clock = clocks.start(URL, "a", max_tokens=11, first_s=0.0)
    assert clocks.slack_s(URL, 0.1, now=0.0) is None  # no step time measured yet
    for i in range(1, 5):  # 4 tokens, 50 ms apart
        clocks.tokens(URL, clock, 1, now=0.05 * i)
    assert clocks.step_s(URL) == pytest.approx(0.05)
    # used 0.2 s, 6 tokens to come at 50 ms: 1.0 - 0.2 - 0.3
    assert clocks.slack_s(URL, 0.1, now=0.2) == pytest.approx(0.5)
    # a stall: one 0.4 s gap, spent from the slack and raising the mean gap
    clocks.tokens(URL, clock, 1, now=0.6)
    assert clocks.step_s(URL) == pytest.approx(0.12)
    assert clocks.slack_s(URL, 0.1, now=0.6) == pytest.approx(1.0 - 0.6 - 5 * 0.12)


def test_the_step_time_is_the_mean_of_the_recent_gaps_only() -> None:
    clocks = DecodeClocks()
    clock = clocks.start(URL, "a", max_tokens=10_000, first_s=0.0)
    clocks.tokens(URL, clock, 1, now=10.0)  # one long gap...
    t = 10.0
    for _ in range(GAPS):  # ...pushed out by GAPS gaps of 10 ms
        t += 0.01
        clocks.tokens(URL, clock, 1, now=t)
    assert clocks.step_s(URL) == pytest.approx(0.01)


def test_the_least_slack_of_the_nodes_streams_and_a_chunk_of_several_tokens() -> None:
    clocks = DecodeClocks()
    old = clocks.start(URL, "old", max_tokens=5, first_s=0.0)
    clocks.tokens(URL, old, 2, now=0.2)  # one chunk of two: two gaps of 100 ms
    assert clocks.step_s(URL) == pytest.approx(0.1)
    clocks.start(URL, "new", max_tokens=101, first_s=0.2)
    clocks.start(URL, "one", max_tokens=1, first_s=0.2)  # no TPOT to keep
    # old: 4 x 0.1 - 0.2 - 2 x 0.1 = 0; new: 100 x 0.1 - 0 - 100 x 0.1 = 0 too, then less
    assert clocks.slack_s(URL, 0.1, now=0.2) == pytest.approx(0.0)
    assert clocks.slack_s(URL, 0.1, now=0.3) == pytest.approx(-0.1)
    assert clocks.streams(URL) == 3
    for key in ("old", "new", "one"):
        clocks.stop(URL, key)
    assert clocks.streams(URL) == 0 and clocks.step_s(URL) is None
    clocks.stop(URL, "old")  # twice, or never started: nothing
