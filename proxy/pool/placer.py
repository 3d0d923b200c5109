"""Where `DisaggBackend` prefills each attempt's prompt (conditional disaggregation): the
rule of placement.py on the router's estimates now, each decision traced and counted, and,
for the TPOT objective, the decode streams timed (decode_clocks.py) while they are
relayed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import aclosing

from proxy.http.backend import BackendError, GenerationRequest, TokenStream
from proxy.pool.decode_clocks import DecodeClocks
from proxy.pool.node_state import Node, Role
from proxy.pool.placement import (
    DisaggMode,
    Placement,
    PlacementConfig,
    PlacementMetrics,
    has_room,
    place,
)
from proxy.pool.registry import NodeRegistry
from proxy.pool.router import Decision, rates
from proxy.trace import TraceStore


class Placer:
    def __init__(
        self,
        registry: NodeRegistry,
        traces: TraceStore,
        config: PlacementConfig,
        metrics: PlacementMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.traces = traces
        self.config = config
        self.metrics = metrics
        self.clocks = DecodeClocks()  # auto with the TPOT objective: the decode streams' slack

    def prefills_locally(
        self, prompt: Sequence[int], waited_s: float = 0.0, ahead_tokens: int = 0
    ) -> bool:
        """Whether `prompt` would be prefilled on a decode node now (no side effect): the
        edge lets such a prompt past the prefill pool's backlog horizon (budget.py). For the
        TTFT objective: it has waited `waited_s` at the edge, behind `ahead_tokens` prompt
        tokens still to prefill that wait there before it."""
        if self.config.mode is DisaggMode.ALWAYS:
            return False
        try:
            return self._placement(prompt, time.perf_counter(), waited_s, ahead_tokens).local
        except (ValueError, BackendError):  # no node to place it on: it waits
            return False

    def place(self, req: GenerationRequest) -> Placement | None:
        """Where this attempt's prompt is prefilled (None: the prefill pool, undecided, as
        `always` does); traced and counted. ValueError or BackendError when no node can
        take it."""
        if self.config.mode is DisaggMode.ALWAYS:
            if self.metrics is not None:
                self.metrics.count_always()
            return None
        prompt, router = req.prompt_token_ids, self.registry.router
        waited_s = time.monotonic() - req.arrived_s
        placement = self._placement(prompt, time.perf_counter(), waited_s)
        self.traces.record(req.request_id, "placed", detail=placement.detail())
        if self.metrics is not None:
            self.metrics.count(placement)
        if placement.local:
            assert placement.local_best is not None
            router.expect(placement.local_best.node, prompt)
        return placement

    def _placement(
        self, prompt: Sequence[int], started: float, waited_s: float = 0.0, ahead_tokens: int = 0
    ) -> Placement:
        """Where `prompt` would be prefilled now (not `always`)."""
        router = self.registry.router
        remote: Decision | None = None
        if self.config.mode is DisaggMode.AUTO and self.registry.routable(Role.PREFILL):
            remote = router.choose(router.estimates(Role.PREFILL, prompt), started)
        pool_rates = rates(self.registry.healthy(Role.PREFILL))
        local = router.estimates(Role.DECODE, prompt, fallback_rates=pool_rates)
        roomy = [e for e in local if has_room(e)]
        pool_wait_s = ahead_tokens / sum(pool_rates) if ahead_tokens and pool_rates else 0.0
        candidates = roomy or (local if remote is None else [])
        return place(self.config, remote, candidates, waited_s, pool_wait_s, self._slack_s)

    def _slack_s(self, node: Node) -> float | None:
        objective = self.config.tpot_slo_s
        return None if objective is None else self.clocks.slack_s(node.url, objective)

    def clocked(
        self, url: str, req: GenerationRequest, chunks: TokenStream, first_s: float | None
    ) -> TokenStream:
        """`chunks`, the stream of `req` from decode node `url`, timed in `clocks` while it
        lasts (auto with the TPOT objective, one choice: else `chunks` itself, no hop more
        per chunk): from `first_s`, when its first token was relayed, or (None) from its
        first chunk here."""
        timed = (
            self.config.mode is DisaggMode.AUTO
            and self.config.tpot_slo_s is not None
            and req.sampling.n == 1
        )
        return self._timed(url, req, chunks, first_s) if timed else chunks

    async def _timed(
        self, url: str, req: GenerationRequest, chunks: TokenStream, first_s: float | None
    ) -> TokenStream:
        key, clock = req.request_id, None
        if first_s is not None:
            clock = self.clocks.start(url, key, req.sampling.max_tokens, first_s)
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    n = len(chunk.token_ids)
                    if clock is None:  # the first token(s): no gap before them
                        now = time.monotonic()
                        clock = self.clocks.start(url, key, req.sampling.max_tokens, now, n)
                    else:
                        self.clocks.tokens(url, clock, n)
                    yield chunk
        finally:
            if clock is not None:
                self.clocks.stop(url, key)
