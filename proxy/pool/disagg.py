"""`DisaggBackend`, the token backend over the node pools of a disaggregated deployment:
prefill pool -> inter-stage queue -> decode pool (`ColocatedBackend`, colocated.py, serves
nodes that prefill and decode locally).

A disaggregated request moves through three stages, and closing its stream (`aclose`, or the
consuming task cancelled) cancels it where it is, from tasks the `NodeClient` owns:

    prefill call in flight   the HTTP call is dropped; Cancel -> prefill node
    inter-stage queue        the entry is removed; Cancel -> prefill node (frees the held KV)
    decode stream            the stream is closed (the decode node aborts on disconnect);
                             Cancel -> decode node, and -> prefill node until a decode token
                             arrived (the KV transfer may be in flight)

The first token is yielded as soon as the prefill node returns it; the request is queued for
decode before that yield, so the client's first write does not delay the decode.

With `kv_streaming`, the prefill call is streamed (`PrefillStream`): the request is queued
for decode as soon as the prefill node accepted it (its KV handle), without a first token, so
a decode node with room reserves the blocks and asks for the KV while the prompt still
computes; the prefill node writes each finished group at once, and the first token travels
to the decode node with the last group. Cancellation is unchanged: the entry is cancelled
wherever it is, and both nodes are told.

Conditional disaggregation (placement.py, placer.py): unless `--disagg-mode always`, each
attempt first decides where its prompt is prefilled. A prompt placed locally goes straight
to a decode node (POST /internal/generate, as to a colocated node): no prefill call, no
inter-stage queue, no KV transfer; it leaves the pre-decode budget as soon as the decode
node accepts it.

A started request whose node is lost (`NodeLost`: its stream broke, went silent for the
stall timeout, or the registry found the node unreachable) is continued elsewhere by
re-prefilling the prompt plus the tokens so far (`migrate_limit` times); the client sees one
stream. A stalled stream's node is told to cancel (again until it answers, see NodeClient),
and a stall on a node that also stopped answering polls marks it down, which moves the rest
of its work at once.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from common.wire.node_messages import (
    DecodeRequest,
    KVHandle,
    PrefillAccepted,
    PrefillRequest,
    PrefillResult,
)
from common.wire.stage import Stage
from proxy.http.backend import BackendError, GenerationRequest, NodeLost, TokenChunk, TokenStream
from proxy.metrics import DisaggMetrics
from proxy.pool.budget import Claim, Limits, PreDecodeBudget
from proxy.pool.client import NodeClient, NodeStream, NodeUnreachable
from proxy.pool.decode_clocks import DecodeClocks
from proxy.pool.interstage import InterStageQueue, QueueEntry
from proxy.pool.node_state import Node, Role
from proxy.pool.placement import DisaggMode, PlacementConfig, PlacementMetrics
from proxy.pool.placer import Placer
from proxy.pool.prefill_stream import PrefillStream
from proxy.pool.registry import NodeRegistry
from proxy.pool.relay import open_generate, relay, report_stall, report_unreachable
from proxy.pool.router import Decision
from proxy.trace import TraceStore

log = logging.getLogger(__name__)

P = TypeVar("P")
Streamed = tuple[QueueEntry, PrefillResult]  # a streamed prefill's queue entry and result


@dataclass(frozen=True)
class DisaggConfig:
    lease_s: float = 30.0  # the prefill lease; the inter-stage queue extends it while waiting
    node_attempts: int = 2  # nodes tried when one turns out unreachable before taking a request
    migrate_limit: int = 1  # re-prefills of a started request after a node failure
    # Stream the KV while the prompt computes (a decode node is engaged after its first chunk).
    kv_streaming: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.lease_s <= 3600:
            raise ValueError(f"lease_s must be in (0, 3600], got {self.lease_s}")
        if self.node_attempts < 1:
            raise ValueError(f"node_attempts must be >= 1, got {self.node_attempts}")
        if not 0 <= self.migrate_limit <= 16:
            raise ValueError(f"migrate_limit must be in [0, 16], got {self.migrate_limit}")


class DisaggBackend:
    """`TokenBackend` over a prefill pool and a decode pool."""

    def __init__(
        self,
        registry: NodeRegistry,
        client: NodeClient,
        queue: InterStageQueue,
        config: DisaggConfig | None = None,
        metrics: DisaggMetrics | None = None,
        traces: TraceStore | None = None,
        budget: PreDecodeBudget | None = None,
        placement: PlacementConfig | None = None,
        placement_metrics: PlacementMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.queue = queue
        self.config = config or DisaggConfig()
        self.metrics = metrics
        self.traces = traces or TraceStore(1)
        self.budget = budget or PreDecodeBudget(lambda: Limits(1 << 30, None))
        where = placement or PlacementConfig(DisaggMode.ALWAYS)
        self.placer = Placer(registry, self.traces, where, placement_metrics)

    async def generate(self, req: GenerationRequest) -> TokenStream:
        """The request's stream. It is pre-decode (in `budget`, held by the edge that
        admitted it) until a decode node takes it; a migration re-enters that stage."""
        try:
            self._admit()
            async with aclosing(self._generate(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.budget.release(req.request_id)

    async def _generate(self, req: GenerationRequest) -> TokenStream:
        emitted: list[int] = []  # token ids yielded so far, over every attempt
        attempt = req
        for migration in range(self.config.migrate_limit + 1):
            try:
                async with aclosing(self._attempt(attempt, req.request_id)) as chunks:
                    async for chunk in chunks:  # closed on every path
                        emitted += chunk.token_ids
                        yield chunk
                return
            except NodeLost as e:
                if e.cause == "stalled":
                    self._stalled(req, e)
                if (
                    migration == self.config.migrate_limit
                    or req.sampling.n > 1  # several choices: no one continuation of them
                    or not emitted
                    or len(emitted) >= req.sampling.max_tokens
                ):
                    raise
                if e.node_down and e.cause == "broken":
                    self.registry.report_failure(e.url, e.message)
                if not self.registry.healthy(Role.DECODE):
                    self._migrated("no_decode_node", e.cause)
                    raise
                self._migrated("started", e.cause)
                self.traces.record(
                    req.request_id,
                    "migrating",
                    detail=f"{e.cause} after {len(emitted)} tokens: {e.message}",
                )
                log.warning(
                    "%s: %s; continuing after %d tokens by re-prefilling (migration %d of %d)",
                    req.request_id,
                    e.message,
                    len(emitted),
                    migration + 1,
                    self.config.migrate_limit,
                )
                attempt = continuation(req, emitted, migration + 1)
                # Already admitted: it re-enters the pre-decode stage without waiting.
                n = len(attempt.prompt_token_ids)
                self.budget.hold(req.request_id, Claim(n, n))

    async def _attempt(self, req: GenerationRequest, budget_id: str) -> TokenStream:
        """Prefill `req`, yield its first token, queue it for decode and relay the stream
        (or, placed locally, relay the whole stream of the decode node that prefills it);
        `budget_id` leaves the pre-decode budget once a decode node has taken it."""
        placement = self.placer.place(req)
        remote = placement.remote if placement is not None else None
        if placement is not None and placement.local:
            assert placement.local_best is not None
            node, uncached = placement.local_best.node, placement.local_best.uncached
            opened = await self._open_local(req, node, uncached)
            if opened is not None:
                stream, ticket = opened
                self.budget.release(budget_id)
                computed = functools.partial(node.computed, ticket)  # at the first token
                chunks = self.placer.clocked(
                    node.url,
                    req,
                    relay(
                        stream, req, self.client, self.queue, traces=self.traces, on_first=computed
                    ),
                    None,
                )
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
                return
            remote = None  # the decode node was unreachable: the prefill pool after all
        if self.config.kv_streaming:
            async with aclosing(self._attempt_streamed(req, budget_id, remote)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        prefill_url, result = await self._prefill(req, self._prefill_on, remote)
        self.budget.prefilled(budget_id)
        first = _first_chunk(result)
        if result.kv is None:
            self.budget.release(budget_id)
            yield first
            return
        entry = self._enqueue(req, result.first_token_id, result.kv, prefill_url)
        self.traces.record(req.request_id, "inter-stage queued", stage=Stage.INTERSTAGE)
        async with aclosing(self._queued(req, entry, first, budget_id, prefill_url)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _queued(
        self,
        req: GenerationRequest,
        entry: QueueEntry,
        first: TokenChunk,
        budget_id: str,
        prefill_url: str,
    ) -> TokenStream:
        """Yield the first token, wait for a decode node to take `entry` (it leaves the
        pre-decode budget then) and relay its stream; the entry is cancelled on any exit
        before that."""
        try:
            first_s = time.monotonic()
            yield first
            stream = await self.queue.wait(entry)
        except BaseException:  # GeneratorExit, CancelledError, the entry's BackendError
            self.queue.cancel(entry)
            raise
        self.budget.release(budget_id)
        async with aclosing(self._decode(req, stream, prefill_url, first_s)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _attempt_streamed(
        self, req: GenerationRequest, budget_id: str, decided: Decision | None
    ) -> TokenStream:
        """`_attempt` with the KV streamed: queued for decode at the prefill node's
        acceptance, first token yielded when it comes, then the decode stream relayed. A
        prefill node lost before the first token is retried on another, as without
        streaming (its queue entry cancelled, a new one queued). `decided`: the prefill node
        placement chose already, if it did."""

        def on(node: Node, msg: PrefillRequest, uncached: int) -> Awaitable[Streamed]:
            return self._streamed_on(req, node, msg, uncached)

        prefill_url, (entry, result) = await self._prefill(req, on, decided)
        # No await from here into _queued: the entry is cancelled on every exit.
        self.traces.enter(req.request_id, Stage.INTERSTAGE)
        self.budget.prefilled(budget_id)
        first = _first_chunk(result)
        if result.kv is None:  # finished at its first token: the decode side is not needed
            self.queue.cancel(entry)
            self.budget.release(budget_id)
            yield first
            return
        async with aclosing(self._queued(req, entry, first, budget_id, prefill_url)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _streamed_on(
        self, req: GenerationRequest, node: Node, msg: PrefillRequest, uncached: int
    ) -> Streamed:
        """A streamed prefill on `node`: queued for decode once the node accepted it, then
        its result; on any failure the queue entry is cancelled (NodeUnreachable: the node
        was lost, `_prefill` tries another)."""
        call, accepted, ticket = await self._prefill_streamed_on(node, msg, uncached)
        try:
            try:
                entry = self._enqueue(req, None, accepted.kv, node.url)
            except BaseException:
                call.close()
                raise
            # Queued for decode while still in the PREFILL stage (the KV streams to whichever
            # decode node takes it); INTERSTAGE once the first token came, as without
            # streaming.
            detail = "kv streamed while the prompt computes"
            self.traces.record(req.request_id, "inter-stage queued", detail=detail)
            try:
                return entry, await self._streamed_result(call)
            except BaseException:
                self.queue.cancel(entry)
                raise
            finally:
                call.close()
        finally:
            node.computed(ticket)  # the first token came (or never will, from this call)

    async def _decode(
        self, req: GenerationRequest, stream: NodeStream, prefill_url: str, first_s: float
    ) -> TokenStream:
        self.traces.record(req.request_id, "dispatched", detail=stream.url, stage=Stage.TRANSFER)
        relayed = relay(stream, req, self.client, self.queue, prefill_url, self.traces)
        async with aclosing(self.placer.clocked(stream.url, req, relayed, first_s)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _count(self, name: str, label: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).labels(label).inc()

    def _migrated(self, outcome: str, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.migrations.labels(outcome, cause).inc()

    def _stalled(self, req: GenerationRequest, e: NodeLost) -> None:
        report_stall(self.registry, self.traces, self.metrics, req.request_id, e, "decode")

    def _admit(self) -> None:
        """Refuse, before any prefill, what could only wait: no decode node is up. (Queued
        requests keep waiting if the pool goes down.) Room is the edge's decision."""
        if not self.registry.healthy(Role.DECODE):
            raise BackendError.rejected(
                "no healthy decode node",
                "no_decode_node",
                retry_after=self.queue.config.retry_after_s,
                code="unavailable",
            )

    def prefills_locally(
        self, prompt: Sequence[int], waited_s: float = 0.0, ahead_tokens: int = 0
    ) -> bool:
        """Placer.prefills_locally: what the edge asks (budget.py)."""
        return self.placer.prefills_locally(prompt, waited_s, ahead_tokens)

    @property
    def placement(self) -> PlacementConfig:
        return self.placer.config

    @placement.setter
    def placement(self, config: PlacementConfig) -> None:
        self.placer.config = config

    @property
    def clocks(self) -> DecodeClocks:
        return self.placer.clocks

    async def _open_local(
        self, req: GenerationRequest, node: Node, uncached: int
    ) -> tuple[NodeStream, int] | None:
        """The request's stream from `node`, which prefills it itself (`uncached` prompt
        tokens to compute, the whole prompt's KV to keep), and the send's ticket; None if
        `node` turned out unreachable before taking it (the prefill pool can take it)."""
        n = len(req.prompt_token_ids)
        try:
            with self.registry.track(node, uncached, kv_tokens=n) as ticket:
                try:
                    return await open_generate(self.client, self.registry, node, req), ticket
                except BaseException:
                    node.computed(ticket)
                    raise
        except NodeUnreachable as e:
            self._unreachable(node, e, req.request_id)
            if not self.registry.routable(Role.PREFILL):
                raise
            return None

    async def _prefill(
        self,
        req: GenerationRequest,
        on: Callable[[Node, PrefillRequest, int], Awaitable[P]],
        first: Decision | None = None,
    ) -> tuple[str, P]:
        """Prefill `req` with `on(node, msg, uncached)` on `first`'s node (decided already),
        else the router's pick, trying another while one turns out unreachable before it
        took the request."""
        msg = PrefillRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            lease_s=self.config.lease_s,
        )
        tried: set[str] = set()
        while True:
            if first is not None:
                decision, first = first, None
                self.registry.router.commit(decision, req.prompt_token_ids)
            else:
                decision = self.registry.router.pick(
                    Role.PREFILL, req.prompt_token_ids, frozenset(tried)
                )
            node = decision.node
            self.traces.record(msg.request_id, "routed", detail=decision.detail())
            try:
                return node.url, await on(node, msg, decision.chosen.uncached)
            except NodeUnreachable as e:  # it did not take the request: try another node
                self._unreachable(node, e, msg.request_id)
                self._count("retries", "prefill")
                tried.add(node.url)
                if len(tried) >= self.config.node_attempts:
                    raise

    def _unreachable(self, node: Node, e: NodeUnreachable, request_id: str) -> None:
        report_unreachable(self.registry, self.client, node, e, request_id)

    async def _prefill_on(self, node: Node, msg: PrefillRequest, uncached: int) -> PrefillResult:
        """Prefill on `node`, counting the `uncached` prompt tokens it must compute as its
        queued work (for routing) until the call ends (computed, or never to be)."""
        with self.registry.track(node, uncached) as ticket:
            try:
                stamped = msg.model_copy(update={"epoch": node.epoch})  # stale: 409, retried
                result = await self.client.prefill(node.url, stamped)
            except NodeUnreachable:
                raise
            except BaseException as e:  # cancelled, timed out, failed: it may hold the request
                if not (isinstance(e, BackendError) and e.status < 500):
                    self.client.cancel_soon(node.url, msg.request_id)
                raise
            finally:
                node.computed(ticket)
        if result.request_id != msg.request_id or (result.kv is None) == (
            result.finish_reason is None
        ):
            self.client.cancel_soon(node.url, msg.request_id)
            raise BackendError.failed(f"prefill node {node.url} answered an inconsistent result")
        self.traces.record_node(msg.request_id, node.url, result.events)
        return result

    async def _prefill_streamed_on(
        self, node: Node, msg: PrefillRequest, uncached: int
    ) -> tuple[PrefillStream, PrefillAccepted, int]:
        """Start a streamed prefill on `node`, up to its acceptance (the KV handle); with the
        ticket of the `uncached` prompt tokens it must compute (`Node.computed` once they
        are; here if it fails)."""
        with self.registry.track(node, uncached) as ticket:
            try:
                stamped = msg.model_copy(update={"epoch": node.epoch})  # stale: 409, retried
                call = await self.client.prefill_streamed(node.url, stamped)
            except BaseException as e:  # as in _prefill_on
                node.computed(ticket)
                if not isinstance(e, NodeUnreachable) and not (
                    isinstance(e, BackendError) and e.status < 500
                ):
                    self.client.cancel_soon(node.url, msg.request_id)
                raise
        try:
            return call, await call.accepted(), ticket
        except BaseException:  # it took the request, then failed or was dropped
            node.computed(ticket)
            call.close()
            self.client.cancel_soon(node.url, msg.request_id)
            raise

    async def _streamed_result(self, call: PrefillStream) -> PrefillResult:
        result = await call.result()
        if (result.kv is None) == (result.finish_reason is None):
            raise BackendError.failed(f"prefill node {call.url} answered an inconsistent result")
        self.traces.record_node(call.request_id, call.url, result.events)
        return result

    def _enqueue(
        self,
        req: GenerationRequest,
        first_token_id: int | None,
        kv: KVHandle | None,
        prefill_url: str,
    ) -> QueueEntry:
        assert kv is not None
        decode = DecodeRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            first_token_id=first_token_id,
            sampling=req.sampling,
            kv=kv,
        )
        try:
            return self.queue.submit(decode, prefill_url)
        except BaseException:
            self.client.cancel_soon(prefill_url, req.request_id)
            raise


def _first_chunk(result: PrefillResult) -> TokenChunk:
    lps = None if result.first_logprobs is None else [result.first_logprobs]
    return TokenChunk(
        [result.first_token_id],
        result.finish_reason,
        result.num_cached_tokens,
        lps,
        result.prompt_logprobs,
    )


def continuation(req: GenerationRequest, emitted: list[int], n: int) -> GenerationRequest:
    """`req` continued after `emitted`: the prompt grows by the tokens so far, max_tokens
    shrinks by as many, and seeded sampling resumes at the same output index. A new request
    id: nodes may still hold state under the old one until they notice the failure."""
    sp = req.sampling
    sampling = sp.model_copy(
        update={
            "max_tokens": sp.max_tokens - len(emitted),
            "output_index_base": sp.output_index_base + len(emitted),
            "prompt_logprobs": None,  # the client has them from the first attempt
        }
    )
    return GenerationRequest(
        request_id=f"{req.request_id}~{n}",
        prompt_token_ids=[*req.prompt_token_ids, *emitted],
        sampling=sampling,
    )
