"""The edge queue: admission control at the proxy's front door.

At most `max_active` requests are inside the backend (prefill, inter-stage queue, decode) at
once; up to `capacity` more wait here in FIFO order; beyond that a request is refused at once
with 503 and `Retry-After`, so an overloaded proxy never queues without limit. A waiting
request that is cancelled (its client left) just leaves the queue; a slot freed by a finished
request goes straight to the oldest waiter.

`EdgeGatedBackend` puts a `TokenBackend` behind the queue: the slot is taken at the stream's
first `__anext__` and returned when the stream ends or is closed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.wire.stage import Stage
from proxy.http.backend import BackendError, GenerationRequest, TokenBackend, TokenStream
from proxy.metrics import WAIT_BUCKETS
from proxy.trace import TraceStore


@dataclass(frozen=True)
class EdgeConfig:
    max_active: int = 512  # requests inside the backend at once
    capacity: int = 1024  # requests waiting for a slot; a full queue answers 503
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.capacity < 0:
            raise ValueError("edge max_active must be >= 1 and capacity >= 0")
        if self.retry_after_s <= 0:
            raise ValueError("retry_after_s must be positive")


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


class EdgeQueue:
    def __init__(self, config: EdgeConfig, metrics: EdgeMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def active(self) -> int:
        return self._active

    @property
    def depth(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the `max_active` slots for the body of the `with`."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        arrived = time.monotonic()
        if self._active < self.config.max_active and not self._waiters:
            self._active += 1
            self._admitted(arrived)
            return
        if len(self._waiters) >= self.config.capacity:
            self.metrics.exits.labels("rejected").inc()
            raise BackendError.overloaded(
                f"the proxy is at capacity ({self.config.max_active} requests running, "
                f"{len(self._waiters)} waiting)",
                retry_after=self.config.retry_after_s,
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._update()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot was handed over just as we were cancelled
            else:
                self._waiters.remove(waiter)
            self.metrics.exits.labels("cancelled").inc()
            self._update()
            raise
        self._admitted(arrived)  # _release() handed us its slot: _active is unchanged

    def _admitted(self, arrived: float) -> None:
        self.metrics.wait.observe(time.monotonic() - arrived)
        self.metrics.exits.labels("admitted").inc()
        self._update()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the oldest waiter
                self._update()
                return
        self._active -= 1
        self._update()

    def _update(self) -> None:
        self.metrics.depth.set(len(self._waiters))
        self.metrics.active.set(self._active)


class EdgeGatedBackend:
    """A `TokenBackend` whose streams each hold an edge slot while they run."""

    def __init__(
        self, inner: TokenBackend, edge: EdgeQueue, traces: TraceStore | None = None
    ) -> None:
        self.inner = inner
        self.edge = edge
        self.traces = traces

    async def generate(self, req: GenerationRequest) -> TokenStream:
        async with self.edge.slot():
            if self.traces is not None:
                self.traces.record(req.request_id, "edge admitted", stage=Stage.PREFILL)
            async with aclosing(self.inner.generate(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
