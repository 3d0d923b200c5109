"""The edge: the proxy's one admission decision, made before any node sees a request.

A request enters the pipeline only when the pipeline can carry it to decode: fewer than
`max_active` requests are inside, and the pre-decode stage (prefilling, or prefilled and
waiting for a decode node: `proxy.pool.budget`) has room for its prompt. Otherwise it waits
here, in FIFO order, until it fits. The proxy holds at most `max_active + capacity` requests
(inside and waiting); one more is refused at once. A request is also refused at once when its
estimated wait exceeds its patience (`deadline_s`, lowered per request by the
`X-Request-Deadline-Ms` header), and a waiter whose patience runs out leaves with a 503. So
overload costs a client a bounded wait or an early 503, never compute: nothing past the edge
is refused for lack of room.

The estimated wait is the waiters ahead divided by the drain rate: how fast waiters were
admitted lately (`DrainRate`, from hand-overs only: admissions of requests that found no
queue say nothing about capacity). Until a drain rate is measured the estimate is unknown and
a request is not refused for it. `Retry-After` on every refusal is the time the queue now
ahead would take to drain (1 s to 60 s; `retry_after_s` when unknown).

A waiter that is cancelled (its client left) just leaves the queue; room freed by a request
that leaves the pre-decode stage, or that ends, goes straight to the oldest waiter that fits.
One exception to first come, first served: while the oldest waiter waits only for room on
the prefill pool (the backlog horizon), a request whose prompt a decode node would prefill
itself (`--disagg-mode auto`, `PreDecodeBudget.goes_local`) goes past it, since it takes none
of that room.

`EdgeGatedBackend` puts a `TokenBackend` behind the edge: the slot is taken at the stream's
first `__anext__` and returned when the stream ends or is closed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.wire.stage import Stage
from proxy.http.backend import BackendError, GenerationRequest, TokenBackend, TokenStream
from proxy.metrics import WAIT_BUCKETS
from proxy.pool.budget import Claim, PreDecodeBudget
from proxy.trace import TraceStore

REJECT_REASONS = ("full", "deadline", "expired")
# Waiters after the head that each pump checks for passing it (each check estimates a
# placement: bounded, so that an overloaded edge's pumps stay cheap).
BYPASS_SCAN = 16
RETRY_AFTER_MAX_S = 60.0


@dataclass(frozen=True)
class EdgeConfig:
    max_active: int = 512  # requests inside the pipeline at once
    capacity: int = 1024  # more may wait here: max_active + capacity in the proxy, then 503
    retry_after_s: float = 1.0  # Retry-After while no drain rate is measured
    deadline_s: float = 60.0  # the longest a request waits here (0: no limit)

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.capacity < 0:
            raise ValueError("edge max_active must be >= 1 and capacity >= 0")
        if self.retry_after_s <= 0:
            raise ValueError("retry_after_s must be positive")
        if self.deadline_s < 0:
            raise ValueError("deadline_s must be >= 0 (0: no limit)")


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.depth = Gauge(
            "pdserve_edge_queue_depth", "Requests waiting for an edge slot.", registry=registry
        )
        self.active = Gauge(
            "pdserve_edge_active", "Requests admitted past the edge queue.", registry=registry
        )
        self.wait = Histogram(
            "pdserve_edge_wait_seconds",
            "Time from arrival to admission past the edge queue.",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.exits = Counter(
            "pdserve_edge_exits",
            "Requests leaving the edge queue, by outcome (admitted, rejected, cancelled).",
            ["outcome"],
            registry=registry,
        )
        self.rejections = Counter(
            "pdserve_edge_rejections",
            "Requests refused at the edge, before any node saw them, by reason (full: the "
            "proxy holds max_active + capacity; deadline: the estimated wait exceeds the "
            "request's patience; expired: it waited that long).",
            ["reason"],
            registry=registry,
        )
        for reason in REJECT_REASONS:
            self.rejections.labels(reason)
        self.drain_rate = Gauge(
            "pdserve_edge_drain_rate",
            "Waiters admitted per second of backlog lately (0: not measured).",
            registry=registry,
        )
        self.predecode = Gauge(
            "pdserve_edge_predecode",
            "Admitted and not yet taken by a decode node: requests, prompt tokens, and prompt "
            "tokens still to prefill.",
            ["what"],
            registry=registry,
        )
        self.predecode_limit = Gauge(
            "pdserve_edge_predecode_limit",
            "The pre-decode budget's limits now (-1: none).",
            ["what"],
            registry=registry,
        )
        self.admitted = self.exits.labels("admitted")

    def watch(self, edge: EdgeQueue) -> None:
        """The gauges read `edge` when scraped, not on every admission (the budget's limits
        walk the node list: per request, that was a tenth of the proxy's time)."""
        self.depth.set_function(lambda: edge.depth)
        self.active.set_function(lambda: edge.active)
        self.drain_rate.set_function(lambda: edge.drain.rate(time.monotonic()) or 0.0)
        budget = edge.budget
        if budget is None:
            return
        used = {
            "requests": lambda: budget.requests,
            "tokens": lambda: budget.tokens,
            "prefill_tokens": lambda: budget.prefill_tokens,
        }
        for what, value in used.items():
            self.predecode.labels(what).set_function(value)
            self.predecode_limit.labels(what).set_function(_limit(budget, what))


def _limit(budget: PreDecodeBudget, what: str) -> Callable[[], float]:
    def read() -> float:
        value = getattr(budget.limits(), what)
        return -1.0 if value is None else float(value)

    return read


class DrainRate:
    """How fast the edge queue drains: hand-overs per second of *backlog* (time during which
    requests were waiting). Idle time does not count (an empty queue drains nothing because
    nothing waits, not because the pipeline is slow), while a backlog that stops moving
    lowers the rate as it lasts. The rate is the higher of the last `window` hand-overs' and
    of all within `max_age_s`: a refusal on an estimate cannot be taken back, so the estimate
    leans optimistic (a burst's first seconds, when the proxy is busy taking it in, drain
    slowly). None until `min_samples` hand-overs are known."""

    def __init__(
        self,
        window: int = 64,
        max_age_s: float = 60.0,
        min_samples: int = 8,
        keep: int = 1024,
    ) -> None:
        self.window = window
        self.max_age_s = max_age_s
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float]] = deque(maxlen=keep)  # (time, backlog clock)
        self._backlog_s = 0.0  # backlog time before the current backlog
        self._since: float | None = None  # when the current backlog began; None: no backlog

    def waiting(self, now: float, backlogged: bool) -> None:
        """Whether requests are waiting from `now` on."""
        if backlogged and self._since is None:
            self._since = now
        elif not backlogged and self._since is not None:
            self._backlog_s += now - self._since
            self._since = None

    def admitted(self, now: float) -> None:
        self._samples.append((now, self._clock(now)))

    def rate(self, now: float) -> float | None:
        while self._samples and now - self._samples[0][0] > self.max_age_s:
            self._samples.popleft()
        n = len(self._samples)
        if n < self.min_samples:
            return None
        clock = self._clock(now)
        recent = min(n, self.window)
        rates = [
            (k - 1) / (clock - self._samples[n - k][1])
            for k in (recent, n)
            if clock > self._samples[n - k][1]
        ]
        return max(rates) if rates else None

    def _clock(self, now: float) -> float:
        return self._backlog_s + (now - self._since if self._since is not None else 0.0)


@dataclass(eq=False)
class _Waiter:
    request_id: str
    claim: Claim | None  # what it takes from the pre-decode budget
    future: asyncio.Future[None]
    arrived: float  # time.monotonic()


def _prefill_tokens(waiter: _Waiter) -> int:
    """The prompt tokens `waiter` still has to prefill (0 once it is gone)."""
    claim = waiter.claim
    return 0 if claim is None or waiter.future.done() else claim.prefill_tokens


class EdgeQueue:
    def __init__(
        self,
        config: EdgeConfig,
        metrics: EdgeMetrics,
        budget: PreDecodeBudget | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.budget = budget
        self.drain = DrainRate()
        self._active = 0
        self._waiters: deque[_Waiter] = deque()
        if budget is not None:
            budget.add_listener(self.pump)
        metrics.watch(self)

    @property
    def active(self) -> int:
        return self._active

    @property
    def depth(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] = (),
        patience_s: float | None = None,
    ) -> AsyncIterator[None]:
        """Hold a place in the pipeline for the body of the `with`: one of the `max_active`
        slots, and the prompt's claim on the pre-decode budget until the backend releases
        it (or the body ends). `patience_s`: the client's own limit on the wait (the lower
        of it and `deadline_s` applies)."""
        claim = self.budget.claim(prompt_token_ids) if self.budget is not None else None
        await self._acquire(request_id, claim, self._patience(patience_s))
        try:
            yield
        finally:
            self._release(request_id)

    def estimated_wait_s(self, ahead: int, now: float | None = None) -> float | None:
        """How long a request with `ahead` waiters before it would wait; None if unknown."""
        rate = self.drain.rate(time.monotonic() if now is None else now)
        return None if rate is None else (ahead + 1) / rate

    def pump(self) -> None:
        """Admit waiters, oldest first, while the head fits (room freed, or limits grew);
        then any of the next `BYPASS_SCAN` that may pass a head waiting for the prefill
        pool alone (`_passes`)."""
        now = time.monotonic()
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():  # cancelled or expired, not yet removed
                self._waiters.popleft()
                continue
            if not self._fits(head.claim, now - head.arrived):
                break
            self._waiters.popleft()
            self._hand_over(head)
        ahead = _prefill_tokens(self._waiters[0]) if self._waiters else 0
        for waiter in list(itertools.islice(self._waiters, 1, BYPASS_SCAN + 1)):
            if waiter.future.done():
                continue
            if self._passes(waiter.claim, now - waiter.arrived, ahead):
                self._waiters.remove(waiter)
                self._hand_over(waiter)
            else:
                ahead += _prefill_tokens(waiter)
        self._update()

    def _hand_over(self, waiter: _Waiter) -> None:
        self._enter(waiter.request_id, waiter.claim)
        self.drain.admitted(time.monotonic())
        waiter.future.set_result(None)

    # -- internals ---------------------------------------------------------------------------

    def _patience(self, patience_s: float | None) -> float | None:
        limits = [p for p in (self.config.deadline_s, patience_s) if p is not None and p > 0]
        return min(limits) if limits else None

    def _fits(self, claim: Claim | None, waited_s: float = 0.0) -> bool:
        if self._active >= self.config.max_active:
            return False
        return self.budget is None or claim is None or self.budget.fits(claim, waited_s)

    def _passes(self, claim: Claim | None, waited_s: float, ahead_tokens: int) -> bool:
        """Whether `claim` may enter ahead of the waiters: the oldest waits for room on the
        prefill pool alone (the backlog horizon), and `claim`'s prompt would be prefilled
        on a decode node (conditional disaggregation), taking none of that room, having
        waited `waited_s` behind waiters with `ahead_tokens` prompt tokens to prefill. Any
        other wait (slots, decode requests, KV) stays first come, first served."""
        budget = self.budget
        if budget is None or claim is None or self._active >= self.config.max_active:
            return False
        head = next((w for w in self._waiters if not w.future.done()), None)
        if head is None or head.claim is None or not budget.room(head.claim):
            return False
        return budget.room(claim) and budget.goes_local(claim, waited_s, ahead_tokens)

    def _enter(self, request_id: str, claim: Claim | None) -> None:
        self._active += 1
        if self.budget is not None and claim is not None:
            self.budget.hold(request_id, claim)

    async def _acquire(self, request_id: str, claim: Claim | None, patience: float | None) -> None:
        arrived = time.monotonic()
        if (not self._waiters and self._fits(claim)) or (
            self._waiters and self._passes(claim, 0.0, sum(map(_prefill_tokens, self._waiters)))
        ):
            self._enter(request_id, claim)
            self._admitted(arrived)
            return
        ahead = len(self._waiters)
        if self._active + ahead >= self.config.max_active + self.config.capacity:
            raise self._reject(
                "full",
                f"the proxy is at capacity ({self._active} requests in the pipeline, "
                f"{ahead} waiting)",
            )
        wait = self.estimated_wait_s(ahead, arrived)
        if patience is not None and wait is not None and wait > patience:
            raise self._reject(
                "deadline",
                f"the estimated wait for admission ({wait:.1f} s, {ahead} requests ahead) "
                f"exceeds the request's deadline ({patience:g} s)",
            )
        waiter = _Waiter(request_id, claim, asyncio.get_running_loop().create_future(), arrived)
        self._waiters.append(waiter)
        self._update()
        try:
            await asyncio.wait({waiter.future}, timeout=patience)
        except asyncio.CancelledError:
            self._abandon(waiter)
            self.metrics.exits.labels("cancelled").inc()
            raise
        if not waiter.future.done():
            self._abandon(waiter)
            raise self._reject(
                "expired", f"waited {patience:g} s for admission (the request's deadline)"
            )
        self._admitted(arrived)  # pump() admitted it: the slot and the budget are its own

    def _abandon(self, waiter: _Waiter) -> None:
        """`waiter` stops waiting; if it had been admitted in the meantime, its place is given
        back. Either way the next waiter may fit now."""
        if waiter.future.done():
            self._release(waiter.request_id)
        else:
            waiter.future.cancel()
            self._waiters.remove(waiter)
            self.pump()

    def _reject(self, reason: str, message: str) -> BackendError:
        self.metrics.exits.labels("rejected").inc()
        self.metrics.rejections.labels(reason).inc()
        wait = self.estimated_wait_s(len(self._waiters))
        retry_after = (
            self.config.retry_after_s if wait is None else min(max(wait, 1.0), RETRY_AFTER_MAX_S)
        )
        return BackendError.rejected(message, reason, retry_after=retry_after)

    def _admitted(self, arrived: float) -> None:
        self.metrics.wait.observe(time.monotonic() - arrived)
        self.metrics.admitted.inc()
        self._update()

    def _release(self, request_id: str) -> None:
        self._active -= 1
        if self.budget is not None:
            self.budget.release(request_id)  # pumps if it held anything
        self.pump()

    def _update(self) -> None:
        self.drain.waiting(time.monotonic(), bool(self._waiters))


class EdgeGatedBackend:
    """A `TokenBackend` whose streams each hold a place in the pipeline while they run."""

    def __init__(
        self, inner: TokenBackend, edge: EdgeQueue, traces: TraceStore | None = None
    ) -> None:
        self.inner = inner
        self.edge = edge
        self.traces = traces

    async def generate(self, req: GenerationRequest) -> TokenStream:
        async with self.edge.slot(req.request_id, req.prompt_token_ids, req.patience_s):
            if self.traces is not None:
                self.traces.record(req.request_id, "edge admitted", stage=Stage.PREFILL)
            async with aclosing(self.inner.generate(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
