"""Conditional disaggregation's rule (placement.py) on made-up estimates: where a prompt is
prefilled for each mode, and the reason and numbers each decision carries."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from proxy.pool.node_state import Node, NodeStatus, Role
from proxy.pool.placement import (
    DisaggMode,
    PlacementConfig,
    PlacementMetrics,
    place,
)
from proxy.pool.router import Decision, Estimate, Policy

RATE = 400.0  # prefill tokens/s: a CPU core on SmolLM2-135M


def estimate(url: str, role: Role, queued: int, prompt: int, matched: int = 0) -> Estimate:
    return Estimate(Node(url, role, NodeStatus.UP), queued, matched, prompt, RATE)


def remote(queued: int, prompt: int, matched: int = 0) -> Decision:
    chosen = estimate("http://p", Role.PREFILL, queued, prompt, matched)
    return Decision(Policy.COST, chosen, None, 1.0, False)


AUTO = PlacementConfig(DisaggMode.AUTO, local_max_tokens=256)


def test_a_short_prompt_behind_a_long_prefill_queue_prefills_locally() -> None:
    # 1,200 tokens queued on the prefill node: 3 s; the decode node computes 48 in 120 ms.
    p = place(AUTO, remote(1200, 48), [estimate("http://d", Role.DECODE, 0, 48)])
    assert p.local and p.reason == "earlier"
    assert p.local_best is not None and p.local_best.ttft_s == pytest.approx(0.12)
    detail = p.detail()
    assert detail.startswith("auto: local (earlier)")
    assert "decode http://d est 120 ms" in detail and "prefill http://p est 3120 ms" in detail


def test_an_idle_prefill_pool_wins_a_tie() -> None:
    p = place(AUTO, remote(0, 48), [estimate("http://d", Role.DECODE, 0, 48)])
    assert not p.local and p.reason == "not_earlier"


def busy(url: str, streams: int, queued: int, prompt: int) -> Estimate:
    """A decode node's estimate while it decodes `streams` sequences."""
    e = estimate(url, Role.DECODE, queued, prompt)
    for _ in range(streams):
        e.node.sent(0, kv_tokens=64)
    assert e.node.decode_streams() == streams
    return e


def test_a_local_prefill_that_would_cost_the_decode_nodes_streams_more_than_it_saves() -> None:
    # 48 tokens in 120 ms locally hold up 8 streams: 960 ms in all, against 500 ms saved
    # (the prefill node's 200 queued tokens).
    p = place(AUTO, remote(200, 48), [busy("http://d", 8, 0, 48)])
    assert not p.local and p.reason == "stalls_decode"
    assert p.cost_s == pytest.approx(0.96)
    assert "cost to its streams 960 ms" in p.detail()
    # Behind a long prefill queue (3 s saved) the same prompt goes local.
    p = place(AUTO, remote(1200, 48), [busy("http://d", 8, 0, 48)])
    assert p.local and p.reason == "earlier" and p.cost_s == pytest.approx(0.96)


def test_a_ttft_objective_the_prefill_queue_would_miss_sends_the_prompt_to_a_decode_node() -> None:
    # 48 tokens locally hold up 32 streams: 3.84 s in all, against 3.0 s saved (1,200 tokens
    # queued on the prefill node): refused on the cost alone.
    def decide(slo_s: float | None) -> tuple[bool, str]:
        config = PlacementConfig(DisaggMode.AUTO, local_max_tokens=256, ttft_slo_s=slo_s)
        p = place(config, remote(1200, 48), [busy("http://d", 32, 0, 48)])
        assert p.cost_s == pytest.approx(3.84)
        return p.local, p.reason

    assert decide(None) == (False, "stalls_decode")
    # A 2 s objective: the prefill pool's 3.12 s misses it, the decode node's 120 ms meets it.
    assert decide(2.0) == (True, "meets_ttft_slo")
    # A 5 s objective the prefill pool meets: its streams' time is not spent.
    assert decide(5.0) == (False, "stalls_decode")
    # An objective neither meets: the decode node's streams would pay for nothing.
    assert decide(0.1) == (False, "stalls_decode")


def test_the_ttft_objective_counts_the_wait_so_far_and_the_prompts_ahead_at_the_edge() -> None:
    config = PlacementConfig(DisaggMode.AUTO, local_max_tokens=256, ttft_slo_s=5.0)

    def decide(waited_s: float, pool_wait_s: float) -> str:
        p = place(config, remote(1200, 48), [busy("http://d", 32, 0, 48)], waited_s, pool_wait_s)
        return p.reason

    assert decide(0.0, 0.0) == "stalls_decode"  # 3.12 s from the pool: met
    assert decide(1.0, 1.0) == "meets_ttft_slo"  # 5.12 s from the pool, 1.12 s locally
    assert decide(2.0, 0.0) == "meets_ttft_slo"  # 5.12 s
    assert decide(0.0, 2.0) == "meets_ttft_slo"
    assert decide(4.95, 0.0) == "stalls_decode"  # late either way (5.07 s locally)


def test_a_ttft_objective_does_not_lift_the_stall_bound() -> None:
    config = PlacementConfig(DisaggMode.AUTO, local_max_tokens=256, ttft_slo_s=1.0)
    p = place(config, remote(5000, 300), [estimate("http://d", Role.DECODE, 0, 300)])
    assert not p.local and p.reason == "too_long"


def test_the_decode_node_whose_streams_lose_least_is_the_candidate() -> None:
    crowded = busy("http://d1", 12, 0, 48)  # 120 ms + 12 x 120 ms
    quiet = busy("http://d2", 2, 40, 48)  # 220 ms + 2 x 120 ms
    p = place(AUTO, remote(1200, 48), [crowded, quiet])
    assert p.local and p.local_best is quiet


def test_a_long_uncached_prompt_goes_to_the_prefill_pool_however_long_its_queue() -> None:
    p = place(AUTO, remote(5000, 800), [estimate("http://d", Role.DECODE, 0, 800)])
    assert not p.local and p.reason == "too_long"


def test_a_prompt_the_decode_node_has_cached_prefills_there() -> None:
    # A chat's next turn: the decode node holds the earlier turns (it cached its own answer),
    # the prefill node only the first prompt.
    local = estimate("http://d", Role.DECODE, 0, 900, matched=880)
    p = place(AUTO, remote(0, 900, matched=600), [local])
    assert local.uncached == 20 and p.local and p.reason == "earlier"


def test_the_decode_node_with_the_earliest_first_token_is_chosen() -> None:
    busy = estimate("http://d1", Role.DECODE, 400, 48)
    idle = estimate("http://d2", Role.DECODE, 0, 48)
    p = place(AUTO, remote(1000, 48), [busy, idle])
    assert p.local and p.local_best is idle


def test_without_room_or_prefill_node() -> None:
    p = place(AUTO, remote(5000, 48), [])  # no decode node with a free slot and blocks
    assert not p.local and p.reason == "no_room"
    p = place(AUTO, None, [estimate("http://d", Role.DECODE, 0, 800)])
    assert p.local and p.reason == "no_prefill_node"  # rather than failing the request
    with pytest.raises(ValueError):
        place(AUTO, None, [])


def test_the_static_modes() -> None:
    local = [estimate("http://d", Role.DECODE, 0, 48)]
    always = place(PlacementConfig(DisaggMode.ALWAYS), remote(5000, 48), local)
    assert not always.local and always.reason == "mode"
    never = place(
        PlacementConfig(DisaggMode.NEVER), None, [estimate("http://d", Role.DECODE, 0, 2000)]
    )
    assert never.local and never.reason == "mode"


def test_the_tpot_objective_keeps_a_prompt_off_a_decode_node_whose_streams_lack_the_slack() -> None:
    # 48 tokens locally: a 120 ms stall, 3 s earlier than behind 1,200 queued tokens.
    config = PlacementConfig(DisaggMode.AUTO, local_max_tokens=256, tpot_slo_s=0.1)
    local = [estimate("http://d", Role.DECODE, 0, 48)]
    for slack, where, reason in (
        (0.05, False, "misses_tpot_slo"),
        (0.5, True, "earlier"),
        (None, True, "earlier"),  # unknown (no stream timed there yet): as without
    ):
        p = place(config, remote(1200, 48), local, slack_s=lambda node, s=slack: s)
        assert (p.local, p.reason) == (where, reason)
    # the TTFT objective's rescue too: late from the pool, in time locally, but no slack
    rescue = PlacementConfig(DisaggMode.AUTO, 256, ttft_slo_s=5.0, tpot_slo_s=0.1)
    busy_node = [busy("http://d", 32, 0, 48)]  # the cost outweighs the 3 s gain
    p = place(rescue, remote(1200, 48), busy_node, waited_s=4.0, slack_s=lambda node: 1.0)
    assert (p.local, p.reason) == (True, "meets_ttft_slo")
    p = place(rescue, remote(1200, 48), busy_node, waited_s=4.0, slack_s=lambda node: 0.1)
    assert (p.local, p.reason) == (False, "misses_tpot_slo")
    # without the objective the slack is not asked for
    p = place(AUTO, remote(1200, 48), local, slack_s=lambda node: -1.0)
    assert p.local and p.reason == "earlier"


def test_with_the_tpot_objective_a_stall_every_stream_has_slack_for_is_taken() -> None:
    # 32 streams: the cost rule (their summed wait) refuses a 3 s gain; the objective
    # bounds each stream's loss instead, so the slack decides.
    config = PlacementConfig(DisaggMode.AUTO, local_max_tokens=256, tpot_slo_s=0.1)
    busy_node = [busy("http://d", 32, 0, 48)]
    for slack, where, reason in (
        (1.0, True, "fits_tpot_slo"),
        (0.05, False, "stalls_decode"),  # no slack either: the cost rule's refusal stands
        (None, False, "stalls_decode"),  # unknown: as without the objective
    ):
        p = place(config, remote(1200, 48), busy_node, slack_s=lambda node, s=slack: s)
        assert (p.local, p.reason) == (where, reason)
    # never for a first token that comes no earlier
    p = place(config, remote(0, 48), busy_node, slack_s=lambda node: 10.0)
    assert (p.local, p.reason) == (False, "not_earlier")


def test_decisions_are_counted_by_mode_placement_and_reason() -> None:
    registry = CollectorRegistry()
    metrics = PlacementMetrics(registry, DisaggMode.AUTO)
    local = [estimate("http://d", Role.DECODE, 0, 48)]
    metrics.count(place(AUTO, remote(1200, 48), local))
    metrics.count(place(AUTO, remote(0, 48), local))
    metrics.count(place(AUTO, remote(1200, 48), local))

    def value(placement: str, reason: str) -> float | None:
        labels = {"mode": "auto", "placement": placement, "reason": reason}
        return registry.get_sample_value("pdserve_proxy_placements_total", labels)

    assert value("local", "earlier") == 2 and value("remote", "not_earlier") == 1


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        PlacementConfig(local_max_tokens=-1)
    for slo_s in (0.0, -1.0):
        with pytest.raises(ValueError):
            PlacementConfig(ttft_slo_s=slo_s)
        with pytest.raises(ValueError):
            PlacementConfig(tpot_slo_s=slo_s)
