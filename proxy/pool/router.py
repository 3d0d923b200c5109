"""Where a prompt is prefilled: a choice that weighs each node's cache against its queue.

For each candidate node the router knows (from its last /state, plus what this proxy sent
since) the prompt tokens queued there and the node's measured prefill speed, and (from the
node's KV events, kv_index.py) how many leading tokens of this prompt its cache holds (or will
hold: a prompt routed to a node counts as cached there while it computes). The
`cost` policy estimates each node's time to first token as

    (queued tokens + this prompt's uncached tokens on that node) / that node's prefill rate

and takes the smallest: a cache hit wins only when it saves more than the queue costs ("the
cache hit that loses": 4,000 cached tokens behind 450 ms of queued work lose to an idle node
that recomputes them in 240 ms). The KV transfer that follows is the same whichever prefill
node computes, so it is left out. The other policies, for comparison:

    cache-affinity  the node holding the longest prefix (ties: the shorter queue)
    least-load      the node with the fewest queued prompt tokens (the cache ignored)
    round-robin     the next node in turn

Every decision is returned with its numbers (the trace's "routed" row shows them) and
counted, with whether the most-cached node and the least-queued one were the same node.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from prometheus_client import CollectorRegistry, Counter

from proxy.pool.kv_index import KVIndex
from proxy.pool.node_state import Node, Role

DEFAULT_PREFILL_RATE = 2000.0  # tokens/s, until some node has measured its own


class Policy(str, Enum):
    COST = "cost"
    CACHE_AFFINITY = "cache-affinity"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"


POLICIES = tuple(p.value for p in Policy)


@dataclass(frozen=True)
class Estimate:
    node: Node
    queued_tokens: int
    matched_tokens: int
    prompt_tokens: int
    rate: float  # prefill tokens per second

    @property
    def queue_s(self) -> float:
        return self.queued_tokens / self.rate

    @property
    def uncached(self) -> int:
        """This prompt's tokens the node must compute (its cache holds the rest)."""
        return self.prompt_tokens - self.matched_tokens

    @property
    def ttft_s(self) -> float:
        return (self.queued_tokens + self.uncached) / self.rate

    def describe(self) -> str:
        return (
            f"{self.node.url} est {self.ttft_s * 1000:.0f} ms (queue {self.queue_s * 1000:.0f} "
            f"ms, {self.matched_tokens}/{self.prompt_tokens} tokens cached)"
        )


@dataclass(frozen=True)
class Decision:
    policy: Policy
    chosen: Estimate
    best_other: Estimate | None  # the other candidate with the lowest estimate
    decided_us: float
    disagree: bool  # the most-cached node is not the least-queued one

    @property
    def node(self) -> Node:
        return self.chosen.node

    def detail(self) -> str:
        """The trace row's detail; it ends with the chosen node's URL."""
        other = f"; best other {self.best_other.describe()}" if self.best_other else ""
        return (
            f"{self.policy.value}: {self.chosen.describe()}{other}; decided in "
            f"{self.decided_us:.0f} us; prefill {self.node.url}"
        )


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "pdserve_proxy_routing_decisions_total",
            "Prefill routing decisions, by policy and by whether the node with the longest "
            "cached prefix was also the one with the shortest queue",
            ["policy", "cache_vs_queue"],
            registry=registry,
        )


class Router:
    def __init__(
        self,
        candidates: Callable[[Role, frozenset[str]], list[Node]],
        policy: Policy = Policy.COST,
        index: KVIndex | None = None,
        metrics: RoutingMetrics | None = None,
    ) -> None:
        self._candidates = candidates  # healthy nodes of a role, rotated (round robin ties)
        self.policy = policy
        self.index = index
        self.metrics = metrics

    def pick(
        self, role: Role, prompt_token_ids: Sequence[int], exclude: frozenset[str] = frozenset()
    ) -> Decision:
        """The node to prefill on (raises BackendError if there is none)."""
        started = time.perf_counter()
        decision = self.choose(self.estimates(role, prompt_token_ids, exclude), started)
        self.commit(decision, prompt_token_ids)
        return decision

    def estimates(
        self,
        role: Role,
        prompt_token_ids: Sequence[int],
        exclude: frozenset[str] = frozenset(),
        fallback_rates: Sequence[float] = (),
    ) -> list[Estimate]:
        """Each candidate node's estimate for the prompt (no side effect; BackendError if
        there is no candidate). A node that has not measured its prefill rate borrows the
        median of its role's measured rates, else of `fallback_rates` (another pool's)."""
        nodes = self._candidates(role, exclude)
        known = rates(nodes) or list(fallback_rates)
        return [self._estimate(n, prompt_token_ids, known) for n in nodes]

    def choose(self, estimates: list[Estimate], started: float) -> Decision:
        """The policy's pick among `estimates` (not empty), with the numbers behind it."""
        chosen = self._choose(estimates)
        others = [e for e in estimates if e is not chosen]
        best_other = min(others, key=lambda e: e.ttft_s) if others else None
        most_cached = max(estimates, key=lambda e: e.matched_tokens)
        least_queued = min(estimates, key=lambda e: e.queued_tokens)
        disagree = most_cached.matched_tokens > 0 and most_cached is not least_queued
        decided_us = (time.perf_counter() - started) * 1e6
        return Decision(self.policy, chosen, best_other, decided_us, disagree)

    def commit(self, decision: Decision, prompt_token_ids: Sequence[int]) -> None:
        """The prompt goes to `decision.node`: its blocks count as there while they compute,
        and the decision is counted."""
        self.expect(decision.node, prompt_token_ids)
        if self.metrics is not None:
            label = "disagree" if decision.disagree else "agree"
            self.metrics.decisions.labels(policy=self.policy.value, cache_vs_queue=label).inc()

    def expect(self, node: Node, prompt_token_ids: Sequence[int]) -> None:
        """`node` computes the prompt: its blocks count as cached there until its events
        report them (kv_index.py)."""
        if self.index is not None:
            self.index.expect(node, prompt_token_ids)

    def _estimate(self, node: Node, prompt: Sequence[int], known: list[float]) -> Estimate:
        rate = node.state.prefill_tokens_per_s if node.state is not None else None
        if not rate or rate <= 0:
            rate = statistics.median(known) if known else DEFAULT_PREFILL_RATE
        matched = 0
        if self.index is not None and self.policy is not Policy.LEAST_LOAD:
            matched = min(self.index.matched_tokens(node, prompt), len(prompt) - 1)
        return Estimate(node, node.prefill_load(), max(0, matched), len(prompt), rate)

    def _choose(self, estimates: list[Estimate]) -> Estimate:
        match self.policy:
            case Policy.COST:
                return min(estimates, key=lambda e: e.ttft_s)
            case Policy.CACHE_AFFINITY:
                return min(estimates, key=lambda e: (-e.matched_tokens, e.queued_tokens))
            case Policy.LEAST_LOAD:
                return min(estimates, key=lambda e: (e.queued_tokens, e.node.inflight))
            case Policy.ROUND_ROBIN:
                return estimates[0]  # the candidates come rotated by one each pick


def rates(nodes: list[Node]) -> list[float]:
    """The prefill rates the nodes have measured."""
    out = []
    for n in nodes:
        rate = n.state.prefill_tokens_per_s if n.state is not None else None
        if rate:
            out.append(rate)
    return out
