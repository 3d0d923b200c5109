"""The prefill router's policies on made-up nodes: the reference example ("the cache hit that
loses"), the other policies, and the numbers every decision carries."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from proxy.http.backend import BackendError
from proxy.pool.kv_index import KVIndex, NodeCache
from proxy.pool.node_state import Node, NodeState, NodeStatus, Role
from proxy.pool.router import DEFAULT_PREFILL_RATE, Policy, Router, RoutingMetrics

RATE = 4000 / 0.240  # the reference text's node recomputes 4,000 tokens in 240 ms


class Cached:
    """A stand-in for KVIndex: how many leading tokens of any prompt each node holds."""

    def __init__(self, matched: dict[str, int]) -> None:
        self.matched = matched
        self.expected: list[str] = []  # where prompts were sent

    def matched_tokens(self, node: Node, prompt: Sequence[int]) -> int:
        return self.matched.get(node.url, 0)

    def expect(self, node: Node, prompt: Sequence[int]) -> None:
        self.expected.append(node.url)


def node(url: str, queued_tokens: int, rate: float | None = RATE) -> Node:
    n = Node(url, Role.PREFILL, status=NodeStatus.UP)
    n.state = NodeState(
        role="prefill", model_fingerprint="m", queued_prefill_tokens=queued_tokens,
        prefill_tokens_per_s=rate,
    )  # fmt: skip
    return n


def router(nodes: list[Node], policy: Policy, cached: dict[str, int]) -> Router:
    def candidates(role: Role, exclude: frozenset[str]) -> list[Node]:
        out = [n for n in nodes if n.url not in exclude]
        if not out:
            raise BackendError.unavailable("no healthy prefill node")
        return out

    return Router(candidates, policy, Cached(cached), RoutingMetrics(CollectorRegistry()))  # type: ignore[arg-type]


PROMPT = list(range(6000))


def test_the_cache_hit_that_loses() -> None:
    """6,000-token prompt; A holds 4,000 of it behind 450 ms of queued work, B is idle."""
    a, b = node("http://a", queued_tokens=int(0.450 * RATE)), node("http://b", 0)
    decision = router([a, b], Policy.COST, {"http://a": 4000}).pick(Role.PREFILL, PROMPT)
    assert decision.node is b
    assert decision.chosen.ttft_s == pytest.approx(0.360)  # 6,000 tokens at 16.7k/s
    assert decision.best_other is not None and decision.best_other.node is a
    assert decision.best_other.ttft_s == pytest.approx(0.570)  # 450 ms + 2,000 tokens
    assert decision.disagree  # the cache says A, the queue says B
    detail = decision.detail()
    assert detail.startswith("cost: http://b est 360 ms") and detail.endswith("prefill http://b")
    assert "4000/6000 tokens cached" in detail and "decided in" in detail
    # Locality alone picks A, and the user waits 210 ms longer.
    affinity = router([a, b], Policy.CACHE_AFFINITY, {"http://a": 4000}).pick(Role.PREFILL, PROMPT)
    assert affinity.node is a


def test_with_a_short_queue_the_cache_wins() -> None:
    a, b = node("http://a", queued_tokens=0), node("http://b", 0)
    decision = router([a, b], Policy.COST, {"http://a": 4000}).pick(Role.PREFILL, PROMPT)
    assert decision.node is a and decision.chosen.ttft_s == pytest.approx(0.120)
    assert not decision.disagree


def test_least_load_ignores_the_cache_and_round_robin_takes_turns() -> None:
    a, b = node("http://a", queued_tokens=100), node("http://b", 0)
    least = router([a, b], Policy.LEAST_LOAD, {"http://a": 4000}).pick(Role.PREFILL, PROMPT)
    assert least.node is b and least.chosen.matched_tokens == 0
    rr = router([a, b], Policy.ROUND_ROBIN, {})
    assert rr.pick(Role.PREFILL, PROMPT).node is a  # (the registry rotates the candidates)


def test_an_unmeasured_node_borrows_the_others_rate_and_a_full_hit_still_computes_one() -> None:
    a, b = node("http://a", 0, rate=None), node("http://b", 0, rate=1000.0)
    decision = router([a, b], Policy.COST, {"http://a": 6000}).pick(Role.PREFILL, PROMPT)
    assert decision.chosen.node is a and decision.chosen.rate == 1000.0
    assert decision.chosen.matched_tokens == 5999  # one token is always computed
    alone = router([node("http://c", 0, rate=None)], Policy.COST, {}).pick(Role.PREFILL, PROMPT)
    assert alone.chosen.rate == DEFAULT_PREFILL_RATE


def test_decisions_are_counted_by_agreement() -> None:
    a, b = node("http://a", queued_tokens=int(0.450 * RATE)), node("http://b", 0)
    r = router([a, b], Policy.COST, {"http://a": 4000})
    r.pick(Role.PREFILL, PROMPT)
    r.pick(Role.PREFILL, PROMPT, exclude=frozenset({"http://b"}))
    assert r.metrics is not None
    counter = r.metrics.decisions
    assert counter.labels(policy="cost", cache_vs_queue="disagree")._value.get() == 1
    assert counter.labels(policy="cost", cache_vs_queue="agree")._value.get() == 1


def test_a_prompt_counts_as_cached_where_it_was_sent_until_its_blocks_are_stored() -> None:
    """A new tenant: its first prompt is computing on A (nothing stored yet); B has other work
    queued. The next prompt with the same prefix joins A, where only its own tokens remain,
    instead of recomputing the prefix on B."""
    a, b = node("http://a", 0), node("http://b", queued_tokens=3000)
    index = KVIndex(None, "secret")  # type: ignore[arg-type]  # no node client: no resyncs
    try:
        for n in (a, b):
            index.caches[n.url] = cache = NodeCache(n.url, n.url, "tcp://-", 16, b"salt", 1024)
            cache.load(last=0, keys=[])
        r = Router(lambda role, exclude: [a, b], Policy.COST, index)
        system = list(range(4000))
        first = r.pick(Role.PREFILL, system + [1, 2, 3])
        assert first.node is a and first.chosen.matched_tokens == 0
        a.sent(first.chosen.uncached)  # what the proxy counts as queued on A
        second = r.pick(Role.PREFILL, system + [7, 8, 9])
        assert second.node is a and second.chosen.matched_tokens == 4000
        assert second.best_other is not None and second.best_other.matched_tokens == 0
        # The events say the blocks are stored: no longer pending, still matched.
        cache = index.caches["http://a"]
        keys = list(cache.pending)
        assert len(keys) == 250 and cache.apply(1, [[True, k] for k in keys])
        assert not cache.pending and index.matched_tokens(a, system) == 4000
        # Removed blocks are gone, and nothing expected is left behind.
        assert cache.apply(251, [[False, k] for k in keys])
        assert index.matched_tokens(a, system) == 0
    finally:
        index.close()
