"""The proxy's Prometheus metrics, in one `CollectorRegistry` per proxy (no global state).

- `ProxyMetrics` (a `ProxyHooks`): requests by endpoint and outcome, in-flight requests,
  TTFT, inter-token latency, end-to-end latency.
- `InterStageMetrics`: the inter-stage queue's depth, wait time, exits and lease extensions.
- `metrics_handler(registry)`: the `GET /metrics` route.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from proxy.http.backend import LOSS_CAUSES, BackendError
from proxy.http.errors import ApiError
from proxy.http.hooks import ProxyHooks

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
)  # fmt: skip
# 100 us to 5 s in steps of 1.25x (as the nodes' step times: tails compared side by side).
ITL_BUCKETS = tuple(round(1e-4 * 1.25**k, 7) for k in range(50))
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class CountedHistogram:
    """A Prometheus histogram whose `observe(value, count)` records `count` observations of
    `value` at the cost of one: a chunk of k tokens is k inter-token gaps, and observing them
    one by one with prometheus_client (a bucket scan and a lock each, ~1.2 us) was ~12% of a
    relayed token's cost at full load. Exposed as `prometheus_client.Histogram` would be
    (`_bucket`, `_count`, `_sum`); observed and collected on the event loop's thread."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = [float(b) for b in sorted(buckets)]
        if not self._bounds or self._bounds[-1] != math.inf:
            self._bounds.append(math.inf)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect_left(self._bounds, value)] += count  # bucket i: value <= bound i
        self._sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip(self._bounds, self._counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=self._sum
        )


@dataclass
class _Timing:
    endpoint: str
    received: float
    last_token: float | None = None


class ProxyMetrics(ProxyHooks):
    """Request-level metrics from the HTTP layer's hooks."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdserve_proxy_requests",
            "Generation requests by endpoint and outcome "
            "(stop, length, client_error, rejected: refused before any node saw it, "
            "server_error, cancelled).",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "pdserve_proxy_requests_in_flight", "Requests being served.", registry=registry
        )
        self.ttft = Histogram(
            "pdserve_proxy_ttft_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = CountedHistogram(
            "pdserve_proxy_itl_seconds",
            "Inter-token latency (a chunk of k tokens: k gaps, each its arrival's gap / k).",
            ITL_BUCKETS,
            registry,
        )
        self.relay = Histogram(
            "pdserve_proxy_relay_seconds",
            "Streaming: time from a token chunk's arrival from a node to its event written to "
            "the client (detokenizing, stop strings, the write).",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pdserve_proxy_e2e_seconds",
            "Request latency, received to finished.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._live: dict[str, _Timing] = {}

    def on_received(self, request_id: str, endpoint: str) -> None:
        self._live[request_id] = _Timing(endpoint, time.monotonic())
        self.in_flight.inc()

    def on_tokens(self, request_id: str, num_tokens: int) -> None:
        timing = self._live.get(request_id)
        if timing is None or num_tokens <= 0:
            return
        now = time.monotonic()
        if timing.last_token is None:
            self.ttft.observe(now - timing.received)
        else:
            self.itl.observe((now - timing.last_token) / num_tokens, num_tokens)
        timing.last_token = now

    def on_relayed(self, request_id: str, seconds: float) -> None:
        self.relay.observe(seconds)

    def on_finished(
        self, request_id: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        timing = self._end(request_id, finish_reason)
        if timing is not None:
            self.e2e.observe(time.monotonic() - timing.received)

    def on_error(self, request_id: str, error: ApiError, stream_started: bool) -> None:
        if isinstance(error, BackendError) and error.reject_reason is not None:
            outcome = "rejected"
        else:
            outcome = "client_error" if error.status < 500 else "server_error"
        self._end(request_id, outcome)

    def on_cancelled(self, request_id: str, reason: str) -> None:
        self._end(request_id, "cancelled")

    def _end(self, request_id: str, outcome: str) -> _Timing | None:
        timing = self._live.pop(request_id, None)
        if timing is not None:
            self.in_flight.dec()
            self.requests.labels(timing.endpoint, outcome).inc()
        return timing


class InterStageMetrics:
    """What the inter-stage queue reports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.depth = Gauge(
            "pdserve_interstage_queue_depth",
            "Prefilled requests waiting for decode capacity.",
            registry=registry,
        )
        self.wait = Histogram(
            "pdserve_interstage_wait_seconds",
            "Time from prefilled to accepted by a decode node.",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.exits = Counter(
            "pdserve_interstage_exits",
            "Requests leaving the inter-stage queue, by outcome "
            "(dispatched, cancelled, failed, expired, node_lost: its prefill node was lost).",
            ["outcome"],
            registry=registry,
        )
        self.lease_extensions = Counter(
            "pdserve_interstage_lease_extend_calls",
            "Batched lease extension calls to prefill nodes, by result (ok, error).",
            ["result"],
            registry=registry,
        )
        self.decode_full = Counter(
            "pdserve_interstage_decode_full",
            "Offers a decode node declined as full.",
            registry=registry,
        )


class DisaggMetrics:
    """Recoveries of the disaggregated backend."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.migrations = Counter(
            "pdserve_proxy_migrations",
            "Started requests continued on other nodes after a node failure (re-prefill), by "
            "outcome and cause (broken: the stream or call broke; stalled: the stream went "
            "silent; node_down: the node was found unreachable)",
            ["outcome", "cause"],
            registry=registry,
        )
        self.stalls = Counter(
            "pdserve_proxy_stalls",
            "Token streams that went silent for the stall timeout, by node role",
            ["role"],
            registry=registry,
        )
        self.retries = Counter(
            "pdserve_proxy_prefill_retries",
            "Prefill calls retried on another node because one was unreachable.",
            ["role"],
            registry=registry,
        )
        for outcome in ("started", "no_decode_node"):
            for cause in LOSS_CAUSES:
                self.migrations.labels(outcome, cause)
        for role in ("decode", "both"):
            self.stalls.labels(role)
        self.retries.labels("prefill")


class NodeConnectionMetrics:
    """How many connections the proxy opened to nodes for its streamed calls: a count that
    grows with the traffic means connections are dropped rather than reused."""

    def __init__(self, registry: CollectorRegistry, opened: Callable[[], int]) -> None:
        self._opened = opened
        registry.register(self)  # a collector: collect() below

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "pdserve_proxy_node_connections_opened",
            "Connections opened to nodes for prefill, decode and generate calls (each call "
            "reuses an idle connection to its node when there is one).",
            value=self._opened(),
        )


def metrics_handler(
    registry: CollectorRegistry,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle
