"""What every node server shares: engine thread, /health, /state, /metrics, cancel,
NDJSON token streams, start-up and graceful shutdown.

NodeRole classes (prefill_node.server.PrefillNode, decode_node.server.DecodeNode,
decode_node.colocated.ColocatedNode) add their internal routes; `create_node`
picks one for a role. The engine runs on its own thread (common.engine.loop), so
the event loop only parses, routes and streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine, RequestError
from common.engine.loop import AsyncEngine
from common.engine.scheduler import StepOutput
from common.node.kv_events import KVEventPublisher
from common.node.metrics import NodeMetrics
from common.wire.auth import CLUSTER_TOKEN_ENV, auth_middleware, is_loopback
from common.wire.errors import SERVER_ERROR, ApiError, error_response, invalid_request
from common.wire.fingerprint import Fingerprint
from common.wire.messages import Cancel, Message, MessageError
from common.wire.node_messages import (
    CancelResult,
    GenerateRequest,
    NodeEvent,
    T,
    TokenDelta,
    from_json,
    to_json,
)
from common.wire.prefix import event_key
from common.wire.stage import Stage
from kv_transfer.config import TransferConfig

log = logging.getLogger(__name__)

NodeRole = Literal["prefill", "decode", "both"]
MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True)
class NodeConfig:
    role: NodeRole
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    transfer: TransferConfig = field(default_factory=TransferConfig)
    engine_id: str = ""  # default: role-<random>
    kv_wait_timeout_s: float = 30.0  # decode: give up on KV that never lands
    lease_reap_interval_s: float = 0.1  # prefill: how often expired leases are freed
    # prefill: a write still unfinished this long after the TransferRequest is aborted
    # (its blocks are freed once the layer says it is quiescent, never before)
    sending_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0  # SIGTERM: time to finish in-flight work
    # Fault injection for tests and drills: sleep after each engine step, and (prefill)
    # before posting each KV write, so a request can be caught in a given stage.
    debug_step_delay_s: float = 0.0
    debug_transfer_delay_s: float = 0.0
    # The secret shared with the proxy (common/wire/auth.py): internal endpoints refuse a
    # request without it. None: open, which only a loopback address (or `insecure`) allows.
    cluster_token: str | None = field(default=None, repr=False)
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.cluster_token is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without a cluster token: give "
                f"--cluster-token-file or ${CLUSTER_TOKEN_ENV} (or --insecure to accept the risk)"
            )
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.kv_wait_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("kv_wait_timeout_s must be > 0 and drain_timeout_s >= 0")
        if self.sending_timeout_s <= 0:
            raise ValueError("sending_timeout_s must be > 0")
        if self.debug_step_delay_s < 0 or self.debug_transfer_delay_s < 0:
            raise ValueError("debug delays must be >= 0")


@dataclass(frozen=True)
class NodeRuntime:
    """What a node serves with, complete before the node exists: the engine, the front that
    runs it on its own thread, and the KV compatibility fingerprint."""

    engine_id: str  # this incarnation's name: role-<random> unless configured
    engine: LLMEngine
    front: AsyncEngine
    fingerprint: Fingerprint

    @classmethod
    async def start(cls, config: NodeConfig) -> NodeRuntime:
        """Load the model (off the event loop) and start the engine thread."""
        engine = await asyncio.to_thread(LLMEngine, config.engine)
        fingerprint = Fingerprint.for_kv_cache(engine.kv_cache, engine.weights_hash)
        front = AsyncEngine(
            engine, asyncio.get_running_loop(), step_delay_s=config.debug_step_delay_s
        )
        await front.start()
        engine_id = config.engine_id or f"{config.role}-{uuid.uuid4().hex[:8]}"
        return cls(engine_id, engine, front, fingerprint)


class NodeServer:
    """Base of the role servers. Subclasses set `role` and extend `routes`."""

    role: ClassVar[NodeRole]

    def __init__(self, config: NodeConfig, runtime: NodeRuntime) -> None:
        self.config = config
        self.engine_id = runtime.engine_id
        self.engine = runtime.engine
        self.front = runtime.front
        self.fingerprint = runtime.fingerprint
        self.metrics = NodeMetrics(CollectorRegistry(), self.role, self.state)
        self.engine.on_step = self.metrics.observe_step
        self.draining = False
        self.url = ""
        self._runner: web.AppRunner | None = None  # set while serving HTTP
        self._tasks: set[asyncio.Task[None]] = set()
        # Set once a thread the node cannot serve without died (the engine's, the KV-transfer
        # agent's): /health answers 503 from then on and `serve` exits non-zero (fail fast).
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self.kv_events: KVEventPublisher | None = None  # set by start()

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> str:
        """Start the role's background tasks, then serve HTTP; the URL served."""
        self.spawn(self._watch_engine(), "engine-watch")
        events = self.engine.allocator.record_events()
        self.kv_events = KVEventPublisher(
            self.engine_id, events, self.config.host, self.config.cluster_token
        )
        self.spawn(self.kv_events.run(), "kv-events")
        self.start_role()
        if self.config.cluster_token is None and not is_loopback(self.config.host):
            log.warning(
                "listening on %s with no cluster token (--insecure): anyone who reaches this "
                "port can drive the node", self.config.host,
            )  # fmt: skip
        middlewares: list[Middleware] = [_errors_middleware]
        if self.config.cluster_token is not None:
            middlewares.append(auth_middleware(self.config.cluster_token))
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.add_routes(self.routes())
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        return self.url

    def start_role(self) -> None:
        """NodeRole background tasks (`spawn`). Default: none."""

    def fail(self, reason: str) -> None:
        """A fatal fault: unhealthy at once, and `serve` stops the node (first reason kept)."""
        if self.failed.is_set():
            return
        self.failure = reason
        log.critical("node failed: %s", reason)
        self.failed.set()

    async def _watch_engine(self) -> None:
        await self.front.died.wait()
        self.fail(f"the engine thread died: {self.front.error!r}")

    async def drain(self) -> None:
        """Stop admitting; wait (bounded) until in-flight work is done."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def busy(self) -> bool:
        reqs = self.engine.state()["requests"]
        assert isinstance(reqs, dict)
        return self.engine.has_work() or bool(reqs["held"] or reqs["reserved"])

    async def stop(self) -> None:
        """Cancel what is left, free every block, close everything. Idempotent."""
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()  # cancels handlers: their streams abort requests
            self._runner = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.stop_role()  # no task uses the role's resources any more
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        await self.front.stop()

    async def stop_role(self) -> None:
        """Release role resources; blocks still held or reserved are freed here."""

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Start a task the node keeps a reference to and cancels on stop."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- routes ------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health", self.handle_health),
            web.get("/state", self.handle_state),
            web.get("/metrics", self.handle_metrics),
            web.post("/internal/cancel", self.handle_cancel),
            web.get("/internal/kv_cache", self.handle_kv_cache),
        ]

    async def handle_kv_cache(self, request: web.Request) -> web.Response:
        """The KV-event snapshot: the last event's number and every cached block's key."""
        last, hashes = await self.front.call(self.engine.allocator.cached_hashes)
        secret = self.config.cluster_token
        keys = [event_key(h, secret).hex() for h in hashes]
        return web.json_response({"node": self.engine_id, "last": last, "keys": keys})

    async def handle_health(self, request: web.Request) -> web.Response:
        ok = not self.draining and self.front.error is None and not self.failed.is_set()
        body = {"status": "ok" if ok else "unavailable", "role": self.role}
        return web.json_response(body, status=200 if ok else 503)

    async def handle_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def handle_metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_cancel(self, request: web.Request) -> web.Response:
        msg = await read_message(request, Cancel)
        stage = await self.cancel(msg.request_id)
        if stage is not None:
            self.metrics.cancellations.labels(stage=stage.value).inc()
        return json_message(
            CancelResult(request_id=msg.request_id, found=stage is not None, stage=stage)
        )

    async def cancel(self, request_id: str) -> Stage | None:
        """End `request_id` wherever it is on this node; the stage it was found in (QUEUED,
        RUNNING, HELD, TRANSFER, RESERVED), or None if it was not here."""
        stage = self.engine.stage_of(request_id)
        self.front.abort(request_id)
        return stage

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        """POST /internal/generate: prefill and decode the request here, no KV transfer
        (the colocated node's whole job; a decode node's local prefill, when the proxy
        judges it gives an earlier first token than the prefill pool)."""
        self.check_admitting()
        received = time.time()
        msg = await read_message(request, GenerateRequest)
        outputs = self.front.generate(msg.request_id, msg.prompt_token_ids, msg.sampling)
        self.metrics.requests.labels(outcome="admitted").inc()

        def first(out: StepOutput) -> list[NodeEvent]:
            events = self.engine_events(out, "prefill", "prefill admitted", "prefill done")
            return [("generate received", received), *events]

        return await stream_outputs(
            request, msg.request_id, outputs, None, first, self.metrics.token_gap.observe
        )

    def engine_events(
        self, out: StepOutput, queue: str, admitted: str, first: str
    ) -> list[NodeEvent]:
        """Trace events from a request's first output, and its queue wait as a metric."""
        assert out.times is not None
        arrival, scheduled = out.times
        self.metrics.queue_wait.labels(queue).observe(max(0.0, scheduled - arrival))
        return [(admitted, scheduled), (first, time.time())]

    # -- state -------------------------------------------------------------------

    def model_fingerprint(self) -> str:
        fp = self.fingerprint
        return f"{fp.weights_hash}/{fp.dtype}/bs{fp.block_size}/{fp.kv_layout}"

    def state(self) -> dict[str, object]:
        st = self.engine.state()
        reqs = st["requests"]
        blocks = st["blocks"]
        assert isinstance(reqs, dict) and isinstance(blocks, dict)
        cfg = self.engine.config
        return {
            "role": self.role,
            "engine_id": self.engine_id,
            "ready": True,
            "draining": self.draining,
            "model_fingerprint": self.model_fingerprint(),
            "blocks": blocks,
            "requests": {
                "waiting": reqs["waiting"],
                "running": reqs["running"],
                "transferring": self.transferring(),
                "held": reqs["held"],
                "reserved": reqs["reserved"],
            },
            "capacity": {
                "max_num_seqs": cfg.max_num_seqs,
                "running": reqs["running"],
                "reserved": reqs["reserved"],
                "free_blocks": blocks["free"],
                "block_size": cfg.block_size,
                "block_bytes": self.engine.block_bytes,
            },
            "queued_prefill_tokens": st["queued_prefill_tokens"],
            "prefill_tokens_per_s": st["prefill_tokens_per_s"],
            "prefix_cache": {
                **st["prefix_cache"],  # type: ignore[dict-item]
                "block_size": cfg.block_size,
                "salt": self.engine.scheduler.cache_salt.decode(),
                "kv_events": self.kv_events.endpoint if self.kv_events is not None else None,
            },
            "preemptions": st["preemptions"],
            "integrity_violations": st["integrity_violations"],
        }

    def transferring(self) -> int:
        return 0

    # -- helpers for role handlers -----------------------------------------------

    def check_admitting(self) -> None:
        if self.draining:
            raise ApiError(503, "node is draining", type=SERVER_ERROR, code="draining")
        if self.front.error is not None:
            raise ApiError(503, "node engine stopped", type=SERVER_ERROR, code="engine_dead")


async def read_message(request: web.Request, cls: type[T]) -> T:
    """Parse the body as one `cls` record or raise a 400 ApiError."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "request body too large", code="body_too_large") from None
    try:
        return from_json(body, cls)
    except (MessageError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid_request(str(e)) from None


def json_message(msg: Message, status: int = 200) -> web.Response:
    return web.Response(body=to_json(msg), status=status, content_type="application/json")


def ndjson_response() -> web.StreamResponse:
    return web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})


async def write_error_line(resp: web.StreamResponse, request_id: str, err: ApiError) -> None:
    """The last line of a stream that failed after its headers went out."""
    delta = TokenDelta(
        request_id=request_id,
        token_ids=[],
        error=f"{err.code}: {err.message}",
        error_code=err.code,
    )
    await resp.write(to_json(delta) + b"\n")
    await resp.write_eof()


async def stream_outputs(
    request: web.Request,
    request_id: str,
    outputs: AsyncGenerator[StepOutput, None],
    resp: web.StreamResponse | None = None,
    on_first: Callable[[StepOutput], list[NodeEvent]] | None = None,
    token_gap: Callable[[float], None] | None = None,
) -> web.StreamResponse:
    """Write engine outputs as NDJSON TokenDelta lines until the request finishes.

    `resp` may already be prepared. `on_first(output)` gives the trace events the first line
    carries (called for the output that has the request's engine times). `token_gap(s)` is
    told the seconds between consecutive token lines as this node writes them. A disconnect
    cancels this handler; closing `outputs` then aborts the request.
    """
    if resp is None:
        resp = ndjson_response()
        await resp.prepare(request)
    last: float | None = None
    try:
        async for out in outputs:
            reason = out.finish_reason.wire_name if out.finish_reason is not None else None
            events = on_first(out) if on_first is not None and out.times is not None else []
            delta = TokenDelta(
                request_id=request_id,
                token_ids=out.new_token_ids,
                finish_reason=reason,
                events=events,
                num_cached_tokens=out.num_cached_tokens,
            )
            await resp.write(to_json(delta) + b"\n")
            if out.new_token_ids and token_gap is not None:
                now = time.monotonic()
                if last is not None:
                    token_gap((now - last) / len(out.new_token_ids))
                last = now
    except RuntimeError as e:  # the engine died mid-stream
        delta = TokenDelta(request_id=request_id, token_ids=[], error=str(e))
        await resp.write(to_json(delta) + b"\n")
    finally:
        await outputs.aclose()
    await resp.write_eof()
    return resp


def request_error(e: RequestError) -> ApiError:
    return invalid_request(str(e))


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except RequestError as e:
        return error_response(request_error(e))
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(ApiError(e.status, e.reason, code=str(e.status)))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(
            ApiError(500, "internal error", type=SERVER_ERROR, code="internal_error")
        )
