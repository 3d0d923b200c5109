"""`pdserve proxy`: the OpenAI-compatible front over node pools.

    pdserve proxy --port 8000 --prefill http://h1:9001,http://h2:9001 --decode http://h3:9002
    pdserve proxy --port 8000 --colocated http://h1:9003          # the colocated baseline

Routes: the OpenAI API of `proxy.http.server`, `GET /metrics` (this proxy's registry: requests,
TTFT, ITL, E2E, inter-stage queue), `GET|POST|DELETE /admin/nodes` and `POST
/admin/nodes/role` (`proxy.pool.admin`; `--auto-roles`: `proxy.pool.planner`). The
tokenizer, chat template and context length come from `--model` (default: the built-in
model). SIGINT/SIGTERM stop admission, let in-flight requests finish for
`--shutdown-timeout-s`, cancel the rest on their nodes, and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from common.gc_pacing import PacedCollector
from common.text.tokenizer import Tokenizer
from common.wire.model_card import read_context_length
from common.wire.node_messages import CancelResult
from proxy.edge import EdgeConfig, EdgeGatedBackend, EdgeMetrics, EdgeQueue
from proxy.http.backend import TokenBackend
from proxy.http.server import HealthCheck, ProxyConfig, build_app, make_runner
from proxy.metrics import (
    DisaggMetrics,
    InterStageMetrics,
    NodeConnectionMetrics,
    ProxyMetrics,
    metrics_handler,
)
from proxy.pool.admin import AdminRoutes
from proxy.pool.budget import PreDecodeBudget, pipeline_limits, uncached_tokens
from proxy.pool.client import NodeClient
from proxy.pool.colocated import ColocatedBackend
from proxy.pool.disagg import DisaggBackend, DisaggConfig
from proxy.pool.interstage import InterStageConfig, InterStageQueue
from proxy.pool.kv_index import KVIndex
from proxy.pool.node_state import Role
from proxy.pool.placement import DisaggMode, PlacementConfig, PlacementMetrics
from proxy.pool.planner import AutoRoles
from proxy.pool.registry import NodeRegistry, RegistryConfig
from proxy.pool.roles import RoleMetrics, RoleMover
from proxy.pool.router import Policy, Router, RoutingMetrics
from proxy.settings import ProxySettings
from proxy.trace import MultiHooks, TraceHooks, TraceStore

log = logging.getLogger(__name__)


@dataclass
class ProxyParts:
    """What `build_proxy` wired together (tests and the launcher look inside)."""

    app: web.Application
    registry: NodeRegistry
    client: NodeClient
    queue: InterStageQueue | None
    metrics: CollectorRegistry
    model_name: str
    planner: AutoRoles | None = None  # --auto-roles


def build_proxy(settings: ProxySettings) -> ProxyParts:
    """The proxy app; its nodes are polled and its queue runs while the app is set up."""
    tokenizer = Tokenizer.from_dir(settings.model)
    max_model_len = settings.max_model_len or read_context_length(settings.model)
    metrics = CollectorRegistry()
    traces = TraceStore(settings.trace_capacity)

    def on_cancel(url: str, result: CancelResult) -> None:
        event = "cancel acknowledged" if result.found else "cancel: not held"
        stage = result.stage.value if result.stage is not None else ""
        traces.record(result.request_id, event, owner=url, detail=stage)

    client = NodeClient(settings.timeouts, on_cancel, settings.cluster_token)
    roles = {Role.BOTH} if settings.colocated_mode else {Role.PREFILL, Role.DECODE}
    registry = NodeRegistry(
        client, RegistryConfig(settings.poll_interval_s, frozenset(roles), settings.silent_after_s)
    )
    registry.index = KVIndex(client, settings.cluster_token)
    registry.router = Router(
        registry.candidates, Policy(settings.routing), registry.index, RoutingMetrics(metrics)
    )
    for role, urls in settings.node_urls().items():
        for url in urls:
            registry.add(url, role)
    budget = None
    if not settings.colocated_mode:
        limits = pipeline_limits(registry, settings.interstage_capacity, settings.prefill_backlog_s)
        budget = PreDecodeBudget(limits, uncached_tokens(registry))
    queue, backend = _backend(settings, registry, client, metrics, traces, budget)
    if budget is not None and isinstance(backend, DisaggBackend):
        budget.local = backend.prefills_locally  # past the prefill horizon (budget.py)
    edge_config = EdgeConfig(
        settings.max_active_requests,
        settings.edge_queue_capacity,
        deadline_s=settings.edge_deadline_s,
    )
    edge = EdgeQueue(edge_config, EdgeMetrics(metrics), budget)
    registry.add_listener(lambda node: edge.pump())  # a node came up: the limits may be larger
    app = build_app(
        EdgeGatedBackend(backend, edge, traces),
        tokenizer,
        settings.model_name(),
        max_model_len,
        config=ProxyConfig(
            max_body_bytes=settings.max_body_bytes,
            cluster_token=settings.cluster_token,
            api_key=settings.api_key,
        ),
        hooks=MultiHooks(ProxyMetrics(metrics), TraceHooks(traces, metrics)),
        health_check=_health_check(registry, roles),
    )
    NodeConnectionMetrics(metrics, lambda: client.connections_opened)
    app.router.add_get("/metrics", metrics_handler(metrics))
    traces.add_route(app)
    mover = None
    planner = None
    if queue is not None:
        mover = RoleMover(registry, client, RoleMetrics(metrics), settings.role_drain_timeout_s)
        if settings.auto_roles:
            planner = AutoRoles(registry, mover, queue.oldest_wait_s, settings.planner)
    AdminRoutes(registry, mover).add_to(app)
    app.cleanup_ctx.append(_lifecycle(registry, client, queue, registry.index, planner))
    return ProxyParts(app, registry, client, queue, metrics, settings.model_name(), planner)


def _backend(
    settings: ProxySettings,
    registry: NodeRegistry,
    client: NodeClient,
    metrics: CollectorRegistry,
    traces: TraceStore,
    budget: PreDecodeBudget | None,
) -> tuple[InterStageQueue | None, TokenBackend]:
    config = DisaggConfig(
        lease_s=settings.lease_s,
        migrate_limit=settings.migrate_limit,
        kv_streaming=settings.kv_streaming,
    )
    if settings.colocated_mode:
        return None, ColocatedBackend(registry, client, config, traces, DisaggMetrics(metrics))
    queue_config = InterStageConfig(
        lease_s=settings.lease_s,
        max_wait_s=settings.interstage_max_wait_s,
    )
    queue = InterStageQueue(registry, client, InterStageMetrics(metrics), queue_config)
    registry.add_listener(lambda node: queue.notify_capacity())
    mode = DisaggMode(settings.disagg_mode)
    placement = PlacementConfig(
        mode, settings.local_prefill_max_tokens, settings.slo_ttft_s, settings.slo_tpot_s
    )
    return queue, DisaggBackend(
        registry,
        client,
        queue,
        config,
        DisaggMetrics(metrics),
        traces,
        budget,
        placement,
        PlacementMetrics(metrics, mode),
    )


def _health_check(registry: NodeRegistry, roles: set[Role]) -> HealthCheck:
    async def healthy() -> bool:
        return all(registry.healthy(role) for role in roles)

    return healthy


def _lifecycle(
    registry: NodeRegistry,
    client: NodeClient,
    queue: InterStageQueue | None,
    index: KVIndex,
    planner: AutoRoles | None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        await client.start()
        events = asyncio.get_running_loop().create_task(index.run())  # before the first poll
        await registry.start()
        if queue is not None:
            await queue.start()
        if planner is not None:
            await planner.start()
        try:
            yield
        finally:
            if planner is not None:
                await planner.stop()
            if queue is not None:
                await queue.stop()
            await registry.stop()
            events.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await events
            index.close()
            await client.close()

    return ctx


# -- serving -----------------------------------------------------------------------------------


@dataclass
class RunningProxy:
    runner: web.AppRunner
    parts: ProxyParts
    url: str

    async def stop(self) -> None:
        """Graceful: stop accepting, drain (bounded), cancel the rest, stop the pollers."""
        await self.runner.cleanup()


async def start_proxy(settings: ProxySettings) -> RunningProxy:
    parts = build_proxy(settings)
    runner = make_runner(parts.app, shutdown_timeout=settings.shutdown_timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    return RunningProxy(runner, parts, f"http://{display_host(settings.host)}:{port}")


def display_host(host: str) -> str:
    """A host clients can reach: the wildcard addresses mean this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


async def serve(settings: ProxySettings) -> int:
    """Run the proxy until SIGINT/SIGTERM; 0 after a graceful stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    proxy = await start_proxy(settings)
    # What startup made stays out of later garbage collections: a full collection then
    # scans only what requests allocate, not every module and object of the process (it
    # stalls every stream while it runs: 90 ms when torch was loaded, 24 ms without). And
    # young collections come on a timer, not 25 times a second (common/gc_pacing.py).
    collector = start_collection(settings.gc_interval_s, proxy.parts.metrics)
    try:
        print(f"pdserve proxy ready: {proxy.url}", flush=True)
        await stop.wait()
        log.info("stopping: draining in-flight requests (up to %gs)", settings.shutdown_timeout_s)
    finally:
        await proxy.stop()
        if collector is not None:
            await collector.stop()
    return 0


def start_collection(
    interval_s: float, metrics: CollectorRegistry | None = None
) -> PacedCollector | None:
    """Freeze what startup made; collect on a timer of `interval_s` (None: 0, CPython's own
    collector), its pauses in `metrics`. For a process's entry point only: it changes the
    whole process's GC."""
    if interval_s <= 0:
        gc.collect()
        gc.freeze()
        return None
    collector = PacedCollector(interval_s, metrics)
    collector.start()
    return collector
