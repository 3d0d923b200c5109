"""The node process around its role: the HTTP listener, /health, /state, /metrics, the KV
events publisher, the engine watch, and the current role object, which a role change
replaces (common/node/role_change.py) while everything else stays.

Every request the host does not answer itself goes to the current role's routes, tagged
with that role (`ROLE_KEY`: the epoch check in `read_message`, the eviction note in
`stream_outputs`). A path under /internal/ the current role does not serve is a 409
`wrong_role`: the caller's view of the node is out of date, and the node did not take it.
The host counts the requests its role is handling, so that a drain waits for a handler that
has not reached the engine yet.

    host  GET /health, GET /state, GET /metrics, GET /internal/kv_cache,
          POST /internal/role   RoleChange -> RoleChangeResult (drain, switch, serve)
    role  everything else (common.wire.node_messages lists them)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.node.kv_events import KVEventPublisher
from common.node.role_change import (
    ROLE_MOVES,
    SWITCHABLE,
    DrainFailed,
    RoleState,
    drain_role,
)
from common.node.server import (
    MAX_BODY_BYTES,
    ROLE_KEY,
    NodeConfig,
    NodeRole,
    NodeRuntime,
    NodeServer,
    errors_middleware,
    json_message,
    read_message,
)
from common.wire.auth import auth_middleware, is_loopback
from common.wire.errors import SERVER_ERROR, ApiError
from common.wire.node_messages import (
    ResetPrefixCache,
    ResetPrefixCacheResult,
    RoleChange,
    RoleChangeResult,
)
from common.wire.prefix import event_key

log = logging.getLogger(__name__)

RoleFactory = Callable[[NodeRole], NodeServer]  # a role over the node's runtime
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class NodeHost:
    """One node process. `make_role(role)` builds a role object over the shared runtime
    (the composition root passes it in, so no role imports another)."""

    def __init__(self, config: NodeConfig, runtime: NodeRuntime, make_role: RoleFactory) -> None:
        self.config = config
        self.runtime = runtime
        self.engine = runtime.engine
        self.engine_id = runtime.engine_id
        self.failed = runtime.failure.event
        self._make_role = make_role
        self.epoch = 0
        self.role_state = RoleState.SERVING
        self.role = make_role(config.role)
        self._table: dict[tuple[str, str], Handler] = {}
        self._install(self.role)
        self._inflight = 0  # requests the current role is handling
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.kv_events: KVEventPublisher | None = None
        runtime.metrics.read_state_from(self.state)

    @property
    def failure(self) -> str | None:
        return self.runtime.failure.reason

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> str:
        """Start the background tasks and the role, then serve HTTP; the URL served."""
        self._spawn(self._watch_engine(), "engine-watch")
        events = self.engine.allocator.record_events()
        self.kv_events = KVEventPublisher(
            self.engine_id, events, self.config.host, self.config.cluster_token
        )
        self.engine.allocator.on_event = self.kv_events.notify
        self._spawn(self.kv_events.run(), "kv-events")
        self.role.start()
        if self.config.cluster_token is None and not is_loopback(self.config.host):
            log.warning(
                "listening on %s with no cluster token (--insecure): anyone who reaches this "
                "port can drive the node", self.config.host,
            )  # fmt: skip
        middlewares: list[Middleware] = [errors_middleware]
        if self.config.cluster_token is not None:
            middlewares.append(auth_middleware(self.config.cluster_token))
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.add_routes(self._routes())
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        return self.url

    async def _watch_engine(self) -> None:
        await self.runtime.front.died.wait()
        self.role.fail(f"the engine thread died: {self.runtime.front.error!r}")

    async def drain(self) -> None:
        """Shutdown: stop admitting; wait (bounded) until in-flight work is done."""
        self._stopping()
        await self.role.drain(self.config.drain_timeout_s)

    async def stop(self) -> None:
        """Cancel what is left, free every block, close everything. Idempotent."""
        self._stopping()
        if self._runner is not None:
            await self._runner.cleanup()  # cancels handlers: their streams abort requests
            self._runner = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.role.stop()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        await self.runtime.front.stop()

    def _stopping(self) -> None:
        if self.role_state is not RoleState.STOPPING:
            self._move(RoleState.STOPPING)
        self.role.draining = True

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _move(self, new: RoleState) -> None:
        self.role_state = ROLE_MOVES.move(self.engine_id, self.role_state, new)

    # -- routes ------------------------------------------------------------------

    def _routes(self) -> list[web.RouteDef]:
        return [  # the catch-all last: aiohttp matches in order
            web.get("/health", self.handle_health),
            web.get("/state", self.handle_state),
            web.get("/metrics", self.handle_metrics),
            web.get("/internal/kv_cache", self.handle_kv_cache),
            web.post("/internal/role", self.handle_role),
            web.post("/internal/reset_prefix_cache", self.handle_reset_prefix_cache),
            web.route("*", "/{path:.*}", self._dispatch),
        ]

    def _install(self, role: NodeServer) -> None:
        self._table = {(r.method, r.path): r.handler for r in role.routes()}

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        handler = self._table.get((request.method, request.path))
        if handler is None:
            if request.path.startswith("/internal/"):
                raise ApiError(
                    409,
                    f"this node serves as {self.role.role} (epoch {self.epoch}): "
                    f"{request.method} {request.path} is not served here",
                    code="wrong_role",
                )
            raise web.HTTPNotFound()
        request[ROLE_KEY] = self.role
        self._inflight += 1
        try:
            return await handler(request)
        finally:
            self._inflight -= 1

    async def handle_health(self, request: web.Request) -> web.Response:
        ok = (
            self.role_state is not RoleState.STOPPING
            and self.runtime.front.error is None
            and not self.failed.is_set()
        )
        body = {
            "status": "ok" if ok else "unavailable",
            "role": self.role.role,
            "epoch": self.epoch,
            "role_state": self.role_state.value,
        }
        return web.json_response(body, status=200 if ok else 503)

    async def handle_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def handle_metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.runtime.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_kv_cache(self, request: web.Request) -> web.Response:
        """The KV-event snapshot: the last event's number and every cached block's key."""
        last, hashes = await self.runtime.front.call(self.engine.allocator.cached_hashes)
        secret = self.config.cluster_token
        keys = [event_key(h, secret).hex() for h in hashes]
        return web.json_response({"node": self.engine_id, "last": last, "keys": keys})

    async def handle_reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Forget the cached blocks no request holds (their "removed" events tell the
        proxies' KV indexes)."""
        await read_message(request, ResetPrefixCache)
        blocks = await self.runtime.front.call(self.engine.allocator.reset_cache)
        log.info("prefix cache reset: %d cached blocks forgotten", blocks)
        return json_message(ResetPrefixCacheResult(blocks=blocks))

    def state(self) -> dict[str, object]:
        st = self.role.state()
        prefix = st["prefix_cache"]
        assert isinstance(prefix, dict)
        prefix["kv_events"] = self.kv_events.endpoint if self.kv_events is not None else None
        st["epoch"] = self.epoch
        st["role_state"] = self.role_state.value
        st["switchable"] = self._switchable()
        return st

    def _switchable(self) -> bool:
        return self.config.role in SWITCHABLE

    # -- role change -------------------------------------------------------------

    async def handle_role(self, request: web.Request) -> web.Response:
        msg = await read_message(request, RoleChange)
        return json_message(await self.change_role(msg))

    async def change_role(self, msg: RoleChange) -> RoleChangeResult:
        """Drain the current role, then serve `msg.role` at the next epoch (module doc of
        common/node/role_change.py). ApiError if the change is refused or fails."""
        self._check_change(msg)
        old, started = self.role, time.monotonic()
        timeout = self.config.role_drain_timeout_s
        if msg.drain_timeout_s is not None:
            timeout = msg.drain_timeout_s
        self._move(RoleState.DRAINING)  # one change at a time: no await since the check
        log.info(
            "role change %s -> %s: draining (up to %g s, epoch %d)",
            old.role, msg.role, timeout, self.epoch,
        )  # fmt: skip
        evicted = await self._drain(old, msg.role, timeout)
        switch = self._spawn(self._switch(old, msg.role), "role-switch")
        await asyncio.shield(switch)  # a dropped caller does not stop it half-way
        seconds = time.monotonic() - started
        log.info(
            "role change %s -> %s done: epoch %d, %.2f s, %d requests ended by the drain",
            old.role, msg.role, self.epoch, seconds, evicted,
        )  # fmt: skip
        self.runtime.metrics.role_changes.labels(msg.role, "done").inc()
        return RoleChangeResult(
            previous_role=old.role,  # type: ignore[arg-type]
            role=msg.role,
            epoch=self.epoch,
            drained_s=seconds,
            evicted=evicted,
        )

    def _check_change(self, msg: RoleChange) -> None:
        if not self._switchable():
            raise ApiError(409, f"a {self.config.role} node cannot change role", code="fixed_role")
        if self.role_state is RoleState.STOPPING:
            raise ApiError(503, "the node is stopping", type=SERVER_ERROR, code="draining")
        if self.role_state is not RoleState.SERVING:
            raise ApiError(409, "a role change is under way", code="role_change_in_progress")
        if msg.epoch is not None and msg.epoch != self.epoch:
            raise ApiError(
                409, f"the node is at epoch {self.epoch}, not {msg.epoch}", code="stale_epoch",
                param="epoch",
            )  # fmt: skip
        if msg.role == self.role.role:
            raise ApiError(409, f"the node already serves as {msg.role}", code="same_role")

    async def _drain(self, old: NodeServer, role: NodeRole, timeout_s: float) -> int:
        """The drain; on any failure (or a dropped caller) the old role serves on."""
        grace = self.config.kv_wait_timeout_s + 5.0  # a reservation lands or times out
        try:
            return await drain_role(
                old,
                lambda: self._inflight == 0 and not old.busy(),
                lambda: self.role_state is RoleState.STOPPING,
                timeout_s,
                grace,
            )
        except BaseException as e:
            if self.role_state is RoleState.DRAINING:
                old.draining = False
                self._move(RoleState.SERVING)
                self.runtime.metrics.role_changes.labels(role, "failed").inc()
            if isinstance(e, DrainFailed):
                log.warning("role change called off: %s", e.message)
            raise

    async def _switch(self, old: NodeServer, role: NodeRole) -> None:
        """Retire `old`, check that nothing owns a block, start `role` at the next epoch."""
        self._move(RoleState.SWITCHING)
        await old.retire()
        try:
            await self.runtime.front.call(self.engine.check_integrity)
        except AssertionError as e:  # our invariant: fail fast, the supervisor restarts us
            old.fail(f"KV block books disagree after a role change's drain: {e}")
            raise
        new = self._make_role(role)
        self.epoch += 1
        new.epoch = self.epoch
        new.start()
        self.role = new
        self._install(new)
        if self.role_state is RoleState.STOPPING:  # SIGTERM during the switch
            new.draining = True
        else:
            self._move(RoleState.SERVING)
