"""The per-request ownership trace (DESIGN.md §7): one row per boundary a request crossed,
with the owner that saw it and when.

Rows come from three places: the HTTP layer's hooks (received, validated, tokenized, first
token, finished / error / cancelled, stream closed), the backend (edge admitted, routed,
inter-stage queued and dispatched, migrated, a node's cancel answer), and the nodes
themselves, whose answers carry the boundaries they saw (prefill admitted and done, held,
decode reserved, transfer start and done, decode admitted, first decode token). Node rows
are stamped with the node's wall clock and owned by the node's URL.

`TraceStore` keeps the traces of the most recent requests (bounded), serves them at
`GET /debug/requests/{id}/trace`, and writes one JSON log line per finished request on the
`pdserve.trace` logger.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from common.wire.stage import PIPELINE_STAGES, Stage
from proxy.http.errors import NOT_FOUND, ApiError
from proxy.http.hooks import ProxyHooks
from proxy.http.prepare import PreparedRequest

trace_log = logging.getLogger("pdserve.trace")

PROXY = "proxy"
ATTEMPT_SEP = "~"  # a migrated attempt's request id is "<id>~<n>"


@dataclass(frozen=True)
class TraceRow:
    event: str
    owner: str  # "proxy", or the URL of the node that saw it
    t: float  # wall-clock seconds
    detail: str = ""


@dataclass
class RequestTrace:
    request_id: str
    endpoint: str
    # Rows as plain (event, owner, t, detail) tuples: the garbage collector stops tracking
    # a tuple of strings and floats, and the store keeps thousands of traces of a dozen
    # rows. As TraceRow objects they were 3/4 of the proxy's tracked objects, and every
    # full collection (40 ms under load) walked them.
    raw_rows: list[tuple[str, str, float, str]] = field(default_factory=list)
    outcome: str | None = None  # set when the request ended
    stage: Stage = Stage.EDGE  # where it is in the pipeline (one of PIPELINE_STAGES)

    @property
    def rows(self) -> list[TraceRow]:
        return [TraceRow(*row) for row in self.raw_rows]

    def ordered(self) -> list[TraceRow]:
        return sorted(self.rows, key=lambda r: r.t)  # stable: equal times keep their order

    def to_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "outcome": self.outcome,
            "stage": self.stage.value,
            "rows": [asdict(r) for r in self.ordered()],
        }


def base_id(request_id: str) -> str:
    return request_id.split(ATTEMPT_SEP, 1)[0]


class TraceStore:
    """Traces of the last `capacity` requests, oldest evicted first."""

    def __init__(self, capacity: int = 2048) -> None:
        if capacity < 1:
            raise ValueError("trace capacity must be >= 1")
        self.capacity = capacity
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()

    def start(self, request_id: str, endpoint: str) -> RequestTrace:
        trace = RequestTrace(request_id, endpoint)
        self._traces[request_id] = trace
        while len(self._traces) > self.capacity:
            self._traces.popitem(last=False)
        return trace

    def get(self, request_id: str) -> RequestTrace | None:
        return self._traces.get(request_id)

    def record(
        self,
        request_id: str,
        event: str,
        owner: str = PROXY,
        t: float | None = None,
        detail: str = "",
        stage: Stage | None = None,
    ) -> None:
        """Add a row to a live or recent request's trace (and, with `stage`, say the
        request entered that pipeline stage); unknown ids are ignored."""
        trace = self._traces.get(base_id(request_id))
        if trace is not None:
            trace.raw_rows.append((event, owner, time.time() if t is None else t, detail))
            if stage is not None:
                trace.stage = stage

    def enter(self, request_id: str, stage: Stage) -> None:
        """The request entered `stage` (no row: the boundary is recorded elsewhere)."""
        trace = self._traces.get(base_id(request_id))
        if trace is not None:
            trace.stage = stage

    def record_node(self, request_id: str, owner: str, events: Iterable[tuple[str, float]]) -> None:
        for event, t in events:
            self.record(request_id, str(event)[:64], owner, float(t))

    def finish(self, request_id: str, outcome: str) -> None:
        trace = self._traces.get(request_id)
        if trace is None or trace.outcome is not None:
            return
        trace.outcome = outcome

    def closed(self, request_id: str) -> None:
        """The response is over: the last row, and the request's one log line."""
        trace = self._traces.get(request_id)
        if trace is None:
            return
        self.record(request_id, "stream closed")
        if trace_log.isEnabledFor(logging.INFO):
            trace_log.info(json.dumps({"trace": trace.to_json()}, separators=(",", ":")))

    # -- the route -----------------------------------------------------------------------------

    def add_route(self, app: web.Application) -> None:
        app.router.add_get("/debug/requests/{request_id}/trace", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        trace = self._traces.get(request_id)
        if trace is None:
            err = ApiError(
                404,
                f"no trace for request {request_id!r} (unknown, or older than the last "
                f"{self.capacity} requests)",
                type=NOT_FOUND,
                code="trace_not_found",
            )
            return web.json_response(err.body(), status=404)
        return web.json_response(trace.to_json())


class TraceHooks(ProxyHooks):
    """The HTTP layer's boundaries, as trace rows; cancellations counted by stage."""

    def __init__(self, store: TraceStore, registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.cancellations = Counter(
            "pdserve_proxy_cancellations",
            "Requests cancelled (client gone, shutdown), by the stage they were in "
            "(edge, prefill, interstage, transfer, decode).",
            ["stage"],
            registry=registry,
        )
        for stage in PIPELINE_STAGES:
            self.cancellations.labels(stage.value)

    def on_received(self, request_id: str, endpoint: str) -> None:
        self.store.start(request_id, endpoint)
        self.store.record(request_id, "received")

    def on_validated(self, request_id: str) -> None:
        self.store.record(request_id, "validated")

    def on_prepared(self, request_id: str, prepared: PreparedRequest) -> None:
        n = prepared.num_prompt_tokens
        self.store.record(request_id, "tokenized", detail=f"{n} prompt tokens")

    def on_first_token(self, request_id: str) -> None:
        trace = self.store.get(request_id)
        # Colocated: the first token comes from the node that decodes on. Disaggregated: the
        # request is queued for decode next (INTERSTAGE), or was already.
        decoding = trace is not None and trace.stage is Stage.PREFILL
        self.store.record(request_id, "first token", stage=Stage.DECODE if decoding else None)

    def on_finished(
        self, request_id: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        detail = f"{finish_reason}, {completion_tokens} tokens"
        self.store.record(request_id, "finished", detail=detail)
        self.store.finish(request_id, finish_reason)

    def on_error(self, request_id: str, error: ApiError, stream_started: bool) -> None:
        self.store.record(request_id, "error", detail=f"{error.status} {error.message}"[:300])
        self.store.finish(request_id, "error")

    def on_cancelled(self, request_id: str, reason: str) -> None:
        trace = self.store.get(request_id)
        stage = trace.stage.value if trace is not None else "unknown"
        self.cancellations.labels(stage).inc()
        self.store.record(request_id, "cancelled", detail=f"{reason} during {stage}")
        self.store.finish(request_id, "cancelled")

    def on_closed(self, request_id: str) -> None:
        self.store.closed(request_id)


class MultiHooks(ProxyHooks):
    """Several hooks, called in order."""

    def __init__(self, *hooks: ProxyHooks) -> None:
        self.hooks = hooks
        # The per-token hooks go only to those that do something with them (hot path).
        self._on_tokens = [h for h in hooks if type(h).on_tokens is not ProxyHooks.on_tokens]
        self._on_relayed = [h for h in hooks if type(h).on_relayed is not ProxyHooks.on_relayed]

    def on_received(self, request_id: str, endpoint: str) -> None:
        for h in self.hooks:
            h.on_received(request_id, endpoint)

    def on_validated(self, request_id: str) -> None:
        for h in self.hooks:
            h.on_validated(request_id)

    def on_prepared(self, request_id: str, prepared: PreparedRequest) -> None:
        for h in self.hooks:
            h.on_prepared(request_id, prepared)

    def on_first_token(self, request_id: str) -> None:
        for h in self.hooks:
            h.on_first_token(request_id)

    def on_tokens(self, request_id: str, num_tokens: int) -> None:
        for h in self._on_tokens:
            h.on_tokens(request_id, num_tokens)

    def on_relayed(self, request_id: str, seconds: float) -> None:
        for h in self._on_relayed:
            h.on_relayed(request_id, seconds)

    def on_finished(
        self, request_id: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        for h in self.hooks:
            h.on_finished(request_id, finish_reason, prompt_tokens, completion_tokens)

    def on_error(self, request_id: str, error: ApiError, stream_started: bool) -> None:
        for h in self.hooks:
            h.on_error(request_id, error, stream_started)

    def on_cancelled(self, request_id: str, reason: str) -> None:
        for h in self.hooks:
            h.on_cancelled(request_id, reason)

    def on_closed(self, request_id: str) -> None:
        for h in self.hooks:
            h.on_closed(request_id)
