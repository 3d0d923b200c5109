"""Prometheus metrics of a node, in the node's own registry (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.engine.timing import StepTiming
from common.wire.stage import NODE_STAGES


class _StateCollector(Collector):
    """Gauges read from the node's /state at scrape time (once the host bound it)."""

    def __init__(self) -> None:
        self.state: Callable[[], dict[str, object]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.state is None:
            return
        st = self.state()
        blocks = st.get("blocks")
        reqs = st.get("requests")
        if not isinstance(blocks, dict) or not isinstance(reqs, dict):
            return
        g = GaugeMetricFamily("pdserve_kv_blocks", "KV blocks by state", labels=["state"])
        for name in ("free", "used", "held", "reserved"):
            g.add_metric([name], blocks[name])
        yield g
        q = GaugeMetricFamily(
            "pdserve_node_requests", "Requests on this node by state", labels=["state"]
        )
        for name, value in reqs.items():
            q.add_metric([name], value)
        yield q
        d = GaugeMetricFamily(
            "pdserve_queue_depth", "Requests waiting in a queue", labels=["queue"]
        )
        d.add_metric(["prefill" if st.get("role") == "prefill" else "decode"], reqs["waiting"])
        yield d
        epoch = st.get("epoch")
        if isinstance(epoch, int):
            yield GaugeMetricFamily(
                "pdserve_node_epoch", "Role changes this node went through", value=epoch
            )
        violations = st.get("integrity_violations")
        if isinstance(violations, int):
            yield CounterMetricFamily(
                "pdserve_kv_integrity_violations",
                "Times the engine found its KV block books unbalanced when it went idle",
                value=violations,
            )


# 100 us to 5 s in steps of 1.25x: fine enough to compare a tail (p99) with another within
# a few percent (the decode-tail check compares stream gaps with step times).
STEP_BUCKETS = tuple(round(1e-4 * 1.25**k, 7) for k in range(50))
STEP_PHASES = ("admit", "schedule", "forward", "sample", "output", "total")


class NodeMetrics:
    """One registry per node process: it outlives role changes (common/node/host.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._state = _StateCollector()
        registry.register(self._state)
        self.requests = Counter(
            "pdserve_node_requests_total", "Requests by outcome", ["outcome"], registry=registry
        )
        self.cancellations = Counter(
            "pdserve_cancellations_total", "Cancellations by stage", ["stage"], registry=registry
        )
        self.queue_wait = Histogram(
            "pdserve_queue_wait_seconds",
            "Time a request waited in this node's engine queue before it was first scheduled.",
            ["queue"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.lease_expiries = Counter(
            "pdserve_lease_expiries_total",
            "Held block sets freed by lease expiry",
            registry=registry,
        )
        self.sending_timeouts = Counter(
            "pdserve_sending_timeouts_total",
            "KV writes aborted for running past the sending deadline (freed once quiescent)",
            registry=registry,
        )
        self.kv_wait_timeouts = Counter(
            "pdserve_kv_wait_timeouts_total",
            "Reservations given up because KV never arrived",
            registry=registry,
        )
        self.transfer_seconds = Histogram(
            "pdserve_transfer_seconds",
            "KV transfer latency (request to completion)",
            registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
        )
        self.kv_exposed_seconds = Histogram(
            "pdserve_kv_exposed_seconds",
            "Decode, streamed KV: from the first token sampled at the prefill node to the KV "
            "landed here (the transfer time a request waits for; 0 when it landed first)",
            registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
        )
        self.kv_groups = Counter(
            "pdserve_kv_groups_total",
            "Streamed KV: groups of blocks written (prefill) or landed (decode)",
            registry=registry,
        )
        self.kv_blocks_cached = Counter(
            "pdserve_kv_blocks_cached_total",
            "Decode: blocks of incoming KV found in this node's prefix cache, not transferred",
            registry=registry,
        )
        self.kv_blocks_transferred = Counter(
            "pdserve_kv_blocks_transferred_total",
            "KV blocks moved (prefill: sent; decode: received)",
            registry=registry,
        )
        self.transfer_bytes = Histogram(
            "pdserve_transfer_bytes",
            "Bytes per KV transfer (blocks actually moved)",
            registry=registry,
            buckets=tuple(2**i for i in range(12, 34, 2)),
        )
        self.step_seconds = Histogram(
            "pdserve_engine_step_seconds",
            "Engine step time by phase (admit: commands and landed KV applied; schedule; "
            "forward; sample; output: outputs made and state published; total) and by batch "
            "(decode: decode tokens only; prefill: prompt chunks only; mixed)",
            ["phase", "batch"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        # The step histogram's series, bound once: no label lookup on the engine step.
        self._step_children = {
            kind: [self.step_seconds.labels(phase=p, batch=kind) for p in STEP_PHASES]
            for kind in ("decode", "prefill", "mixed")
        }
        self.token_gap = Histogram(
            "pdserve_node_itl_seconds",
            "Decoding: seconds between consecutive token lines of a stream as this node writes "
            "them (engine step, hand-over to the event loop, the write)",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.transfer_failures = Counter(
            "pdserve_transfer_failures_total", "Failed KV transfers", ["reason"], registry=registry
        )
        self.transfer_refusals = Counter(
            "pdserve_transfer_refusals_total",
            "TransferRequests refused before any byte moved (bad_key: a held request asked "
            "for without its transfer key)",
            ["reason"],
            registry=registry,
        )
        self.transfer_refusals.labels(reason="bad_key")
        self.role_changes = Counter(
            "pdserve_node_role_changes_total",
            "Role changes by the role moved to and outcome (done; failed: back in the old role)",
            ["role", "outcome"],
            registry=registry,
        )
        self.role_evictions = Counter(
            "pdserve_node_role_evictions_total",
            "Requests ended by a role change's drain timeout (decode: migrated by the proxy; "
            "prefill: held KV released)",
            registry=registry,
        )
        # Every label a family can take, at zero, so each family is there from the start.
        for stage in [s.value for s in NODE_STAGES]:
            self.cancellations.labels(stage=stage)
        for reason in ("peer_lost", "backend_error", "aborted_by_peer", "closed"):
            self.transfer_failures.labels(reason=reason)
        for queue in ("prefill", "decode"):
            self.queue_wait.labels(queue)

    def read_state_from(self, state: Callable[[], dict[str, object]]) -> None:
        """The gauges read `state()` (the node's /state) at each scrape."""
        self._state.state = state

    def observe_step(self, t: StepTiming) -> None:
        """One engine step's phases (called on the engine thread; the histograms lock)."""
        children = self._step_children[t.kind]
        for child, seconds in zip(
            children,
            (t.admit_s, t.schedule_s, t.forward_s, t.sample_s, t.output_s, t.total_s),
            strict=True,
        ):
            child.observe(seconds)
