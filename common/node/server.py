"""What every node role shares: the runtime it serves with (engine thread, metrics,
fail-fast flag), cancel, the epoch check, NDJSON token streams and draining.

NodeRole classes (prefill_node.server.PrefillNode, decode_node.server.DecodeNode,
decode_node.colocated.ColocatedNode) add their internal routes; the node's host
(common/node/host.py) serves the current one, built by the factory `create_node` gives it.
The engine runs on its own thread (common.engine.loop), so the event loop only parses,
routes and streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine, RequestError
from common.engine.loop import AsyncEngine, EngineThread
from common.engine.scheduler import OutputKind, StepOutput
from common.engine.sequence import FinishReason
from common.node.metrics import NodeMetrics
from common.wire.auth import CLUSTER_TOKEN_ENV, is_loopback
from common.wire.errors import SERVER_ERROR, ApiError, error_response, invalid_request
from common.wire.fingerprint import Fingerprint
from common.wire.messages import Cancel, Message, MessageError
from common.wire.node_messages import (
    CancelResult,
    GenerateRequest,
    NodeEvent,
    RoleWork,
    T,
    TokenDelta,
    from_json,
    to_json,
)
from common.wire.stage import Stage
from kv_transfer.config import TransferConfig

log = logging.getLogger(__name__)

R = TypeVar("R")

NodeRole = Literal["prefill", "decode", "both"]
MAX_BODY_BYTES = 8 * 2**20
ROLE_CHANGE_CODE = "role_change"  # a stream a role change ended: the proxy continues it


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
    # A role change drains the old role at most this long (unless the call gives its own),
    # then ends what is left: decode streams move (the proxy migrates them), held KV is freed.
    role_drain_timeout_s: float = 30.0
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
        if self.role_drain_timeout_s < 0:
            raise ValueError("role_drain_timeout_s must be >= 0")
        if self.sending_timeout_s <= 0:
            raise ValueError("sending_timeout_s must be > 0")
        if self.debug_step_delay_s < 0 or self.debug_transfer_delay_s < 0:
            raise ValueError("debug delays must be >= 0")


class Failure:
    """Set once a thread the node cannot serve without died (the engine's, the KV-transfer
    agent's): /health answers 503 from then on and `serve` exits non-zero (fail fast)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: str | None = None

    def fail(self, reason: str) -> None:
        """Unhealthy at once, and `serve` stops the node (first reason kept)."""
        if self.event.is_set():
            return
        self.reason = reason
        log.critical("node failed: %s", reason)
        self.event.set()


@dataclass(frozen=True)
class NodeRuntime:
    """What a node serves with, complete before any role exists and kept across role changes:
    the engine, the front that runs it on its own thread, the KV compatibility fingerprint,
    the metrics registry and the fail-fast flag."""

    engine_id: str  # this incarnation's name: role-<random> unless configured
    engine: LLMEngine
    front: AsyncEngine
    fingerprint: Fingerprint
    metrics: NodeMetrics
    failure: Failure

    @classmethod
    async def start(cls, config: NodeConfig) -> NodeRuntime:
        """Load the model and warm it up on the engine thread (off the event loop; on the
        thread that will step it, see EngineThread), then start stepping."""
        thread = EngineThread(step_delay_s=config.debug_step_delay_s)
        try:
            engine = await asyncio.wrap_future(thread.run(lambda: LLMEngine(config.engine)))
            # Before /health answers 200: the first request must not pay for first use.
            seconds = await asyncio.wrap_future(thread.run(engine.warm_up))
        except BaseException:
            thread.stop(timeout=0)  # it ends once the call it runs returns
            raise
        log.info(
            "engine warmed up in %.2f s (%s kernels on %s)",
            seconds,
            engine.kernels.name,
            engine.device,
        )
        fingerprint = Fingerprint.for_kv_cache(engine.kv_cache, engine.weights_hash)
        metrics = NodeMetrics(CollectorRegistry())
        engine.on_step = metrics.observe_step
        front = AsyncEngine(engine, asyncio.get_running_loop(), thread=thread)
        await front.start()
        engine_id = config.engine_id or f"{config.role}-{uuid.uuid4().hex[:8]}"
        return cls(engine_id, engine, front, fingerprint, metrics, Failure())


class NodeServer:
    """One role over a node's runtime; subclasses set `role` and extend `routes`.

    The host (common/node/host.py) owns the listener, /health, /state, /metrics and the
    runtime, and routes each request to the current role; a role change retires this
    object (its tasks end, the runtime and the KV-transfer agent stay) and starts another.
    """

    role: ClassVar[NodeRole]

    def __init__(self, config: NodeConfig, runtime: NodeRuntime) -> None:
        self.config = config
        self.runtime = runtime
        self.engine_id = runtime.engine_id
        self.engine = runtime.engine
        self.front = runtime.front
        self.fingerprint = runtime.fingerprint
        self.metrics = runtime.metrics
        self.failed = runtime.failure.event
        self.draining = False  # no new work: the node stops, or changes role
        self.epoch = 0  # set by the host: the role change this role object serves
        # Requests a role change's drain ended: their streams end with error_code
        # "role_change", so that the proxy continues them elsewhere.
        self.evicted: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Start the role's background tasks."""
        self.start_role()

    def start_role(self) -> None:
        """NodeRole background tasks (`spawn`). Default: none."""

    @property
    def failure(self) -> str | None:
        return self.runtime.failure.reason

    def fail(self, reason: str) -> None:
        """A fatal fault: unhealthy at once, and `serve` stops the node (first reason kept)."""
        self.runtime.failure.fail(reason)

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait up to `timeout_s` until in-flight work is done. True if so."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.busy()

    def busy(self) -> bool:
        reqs = self.engine.state()["requests"]
        assert isinstance(reqs, dict)
        return self.engine.has_work() or bool(reqs["held"] or reqs["reserved"])

    async def retire(self) -> None:
        """End the role's tasks; the runtime (and a KV-transfer agent) stay. Idempotent."""
        self.draining = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Retire, then release what the role still owns (every block it holds)."""
        await self.retire()
        await self.stop_role()  # no task uses the role's resources any more

    async def stop_role(self) -> None:
        """Release role resources; blocks still held or reserved are freed here."""

    def spawn(self, coro: Coroutine[Any, Any, R], name: str) -> asyncio.Task[R]:
        """Start a task the role keeps a reference to and cancels when it retires."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- routes ------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        """The role's routes (the host serves /health, /state, /metrics, kv_cache, role)."""
        return [web.post("/internal/cancel", self.handle_cancel)]

    async def handle_cancel(self, request: web.Request) -> web.Response:
        msg = await read_message(request, Cancel)
        if msg.choice is not None:  # one choice of a request decoding here
            stage = self.engine.stage_of(msg.request_id)
            self.front.abort(msg.request_id, msg.choice)
        else:
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
        await self.front.compile_constraint(msg.sampling)
        outputs = self.front.generate(msg.request_id, msg.prompt_token_ids, msg.sampling)
        self.metrics.requests.labels(outcome="admitted").inc()

        def first(out: StepOutput) -> list[NodeEvent]:
            events = self.engine_events(out, "prefill", "prefill admitted", "prefill done")
            return [("generate received", received), *events]

        return await stream_outputs(
            request,
            msg.request_id,
            outputs,
            None,
            first,
            self.metrics.token_gap.observe,
            msg.sampling.n,
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
            # The proxy's stall timeout is at least 4x this (until session 28 it was never
            # sent, so every stream had the flat --stall-timeout-s).
            "step_time_max_s": st["step_time_max_s"],
            "prefix_cache": {
                **st["prefix_cache"],  # type: ignore[dict-item]
                "block_size": cfg.block_size,
                "salt": self.engine.scheduler.cache_salt.decode(),
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


# request[ROLE_KEY]: the role object the host dispatched the request to
ROLE_KEY = web.RequestKey("pdserve.role", NodeServer)


async def read_message(request: web.Request, cls: type[T]) -> T:
    """Parse the body as one `cls` record or raise a 400 ApiError; a role's work that names
    another epoch than the role's (the proxy saw the node before a role change) is a 409
    `stale_epoch`: the node did not take it."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "request body too large", code="body_too_large") from None
    try:
        msg = from_json(body, cls)
    except (MessageError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid_request(str(e)) from None
    role = request.get(ROLE_KEY)
    if isinstance(msg, RoleWork) and role is not None:
        if msg.epoch is not None and msg.epoch != role.epoch:
            raise ApiError(
                409,
                f"{msg.TYPE} for epoch {msg.epoch}, but this node is a {role.role} node at "
                f"epoch {role.epoch}",
                code="stale_epoch",
                param="epoch",
            )
    return msg


def json_message(msg: Message, status: int = 200) -> web.Response:
    return web.Response(body=to_json(msg), status=status, content_type="application/json")


class _WithFirstLine(web.StreamResponse):
    _send_headers_immediately = False  # aiohttp: the headers wait for the first write


def ndjson_response(with_first_line: bool = False) -> web.StreamResponse:
    """An NDJSON stream. Its headers go out at `prepare` (they tell the proxy the node took
    the request), or, `with_first_line`, together with the first line, in one write: for a
    handler that prepares only once that line is ready."""
    cls = _WithFirstLine if with_first_line else web.StreamResponse
    return cls(headers={"Content-Type": "application/x-ndjson"})


async def write_error_line(resp: web.StreamResponse, request_id: str, err: ApiError) -> None:
    """The last line of a stream that failed after its headers went out."""
    delta = TokenDelta(
        request_id=request_id,
        token_ids=[],
        error=f"{err.code}: {err.message}",
        error_code=err.code,
    )
    await resp.write_eof(to_json(delta) + b"\n")


async def stream_outputs(
    request: web.Request,
    request_id: str,
    outputs: AsyncGenerator[StepOutput, None],
    resp: web.StreamResponse | None = None,
    on_first: Callable[[StepOutput], list[NodeEvent]] | None = None,
    token_gap: Callable[[float], None] | None = None,
    choices: int = 1,
) -> web.StreamResponse:
    """Write engine outputs as NDJSON TokenDelta lines until the request finishes.

    `resp` may already be prepared. `on_first(output)` gives the trace events the first line
    carries (called for the output that has the request's engine times). `token_gap(s)` is
    told the seconds between consecutive token lines as this node writes them. The line that
    finishes the last of the request's `choices` goes out with the body's end, in one write:
    the proxy reads both at once and keeps the connection for its next call. A disconnect
    cancels this handler; closing `outputs` then aborts the request.
    """
    if resp is None:
        resp = ndjson_response()
        await resp.prepare(request)
    last: float | None = None
    unfinished = choices
    role = request.get(ROLE_KEY)
    evicted = role.evicted if role is not None else set()
    try:
        async for out in outputs:
            if out.kind is OutputKind.WAITING:  # preempted, waiting to run: a blank line
                await resp.write(b"\n")  # keeps the stream from looking stalled (proxy)
                continue
            if out.finish_reason is FinishReason.ABORT and request_id in evicted:
                evicted.discard(request_id)
                err = ApiError(503, "the node changed role", code=ROLE_CHANGE_CODE)
                delta = TokenDelta(
                    request_id=request_id,
                    token_ids=[],  # the proxy continues after the tokens it relayed
                    error=f"{err.code}: {err.message}",
                    error_code=err.code,
                )
                await resp.write_eof(to_json(delta) + b"\n")
                break
            reason = out.finish_reason.wire_name if out.finish_reason is not None else None
            events = on_first(out) if on_first is not None and out.times is not None else []
            delta = TokenDelta(
                request_id=request_id,
                token_ids=out.new_token_ids,
                finish_reason=reason,
                events=events,
                num_cached_tokens=out.num_cached_tokens,
                logprobs=out.logprobs,
                prompt_logprobs=out.prompt_logprobs,
                choice=out.choice,
            )
            unfinished -= reason is not None
            if unfinished > 0:
                await resp.write(to_json(delta) + b"\n")
            else:
                await resp.write_eof(to_json(delta) + b"\n")
            if out.new_token_ids and token_gap is not None:
                now = time.monotonic()
                if last is not None:
                    token_gap((now - last) / len(out.new_token_ids))
                last = now
    except RuntimeError as e:  # the engine died mid-stream
        delta = TokenDelta(request_id=request_id, token_ids=[], error=str(e))
        await resp.write_eof(to_json(delta) + b"\n")
    finally:
        await outputs.aclose()
    await resp.write_eof()
    return resp


def request_error(e: RequestError) -> ApiError:
    return invalid_request(str(e), param=e.param)


@web.middleware
async def errors_middleware(
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
