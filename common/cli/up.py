"""`pdserve up`: a whole service on this machine, the proxy in-process and nodes as children.

    pdserve up                         # proxy on :8000, 1 prefill + 1 decode node
    pdserve up --prefill 2 --decode 2 --num-blocks 512
    pdserve up --colocated             # the baseline: one node that prefills and decodes

Nodes are started as `python -m common.cli node --role ...` on free loopback ports, each in
its own session (Ctrl-C reaches only this process, which stops them in order) and, on Linux,
with a parent-death signal so they never outlive it. Their output goes to one log file each.
With `--pin-cores`, node i runs on its own `--threads-per-node` cores (cores
[i*T, (i+1)*T) of this process's CPU set, prefill nodes first), set in the child before exec so
every thread torch starts inherits it; the proxy, in this process, stays on the whole set.
Start-up waits for every node's ready line (or a 200 from its /health); a node that exits or
does not get ready in time fails the launch with the tail of its log. SIGINT/SIGTERM stop the
proxy (draining in-flight requests), then the nodes (SIGTERM, SIGKILL after a grace period);
the exit status is then 0. A node that exits while the service runs (a crash, a SIGKILL, an
engine thread that died) is restarted on the same address after a backoff, at most
`--max-restarts` times (`supervise`); the proxy takes it back once its /health answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from common.cli.logs import setup_logging
from common.cli.models import model_dir
from common.cli.node_process import NODE_HOST, LaunchError, NodeProcess
from common.cli.proxy_args import planner_config
from common.cli.up_args import engine_flags
from common.gc_pacing import PacedCollector
from common.wire.auth import API_KEY_ENV, CLUSTER_TOKEN_ENV, bearer, read_secret
from proxy.main import RunningProxy, start_collection, start_proxy
from proxy.pool.client import NodeTimeouts
from proxy.pool.planner import PlannerConfig
from proxy.settings import GC_INTERVAL_S, ProxySettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpConfig:
    model: str
    host: str = "127.0.0.1"  # the proxy's listen address; nodes stay on loopback
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    colocated: int = 0  # > 0: that many `both` nodes instead of prefill/decode pools
    kv_backend: str | None = None  # None: the node's default
    threads_per_node: int = 1
    pin_cores: bool = False  # node i on cores [i*T, (i+1)*T) of ours, T = threads_per_node
    node_args: tuple[str, ...] = ()  # engine flags and extras, passed to every node
    # Passed after node_args to the nodes of one role only (so they win where both set a flag).
    prefill_node_args: tuple[str, ...] = ()
    decode_node_args: tuple[str, ...] = ()
    startup_timeout_s: float = 180.0
    stop_grace_s: float = 20.0
    log_dir: str | None = None  # default: a new temporary directory
    lease_s: float = 30.0
    max_active_requests: int = 512
    edge_queue_capacity: int = 1024
    edge_deadline_s: float = 60.0
    interstage_capacity: int = 0  # 0: derived from the decode pool
    prefill_backlog_s: float = 2.0
    routing: str = "cost"
    disagg_mode: str = "auto"  # always | never | auto (conditional disaggregation)
    local_prefill_max_tokens: int = 256
    slo_ttft_s: float | None = None  # auto: the TTFT objective (placement.py)
    slo_tpot_s: float | None = None  # auto: the TPOT objective (placement.py)
    kv_streaming: bool = True
    stall_timeout_s: float = NodeTimeouts.stall_s
    silent_after_s: float | None = None
    role_drain_timeout_s: float = 30.0  # a node moved to the other pool drains this long
    auto_roles: bool = False  # the proxy's role planner moves nodes between the pools
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    demo_prompt: str | None = None  # stream one chat completion through the proxy at start
    max_restarts: int = 5  # per node; a node that exits is restarted after a backoff
    # The secret shared by the proxy and the nodes; None: a new one for this run, written to
    # <log dir>/cluster-token (mode 0600). api_key: required on the proxy's /v1/* if set.
    cluster_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    restart_backoff_s: float = 1.0  # doubled after each restart of the same node, up to 30 s

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("node counts must be >= 0")
        if self.colocated == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("--prefill and --decode must be >= 1 (or use --colocated)")
        if self.threads_per_node < 1:
            raise ValueError(f"--threads-per-node must be >= 1, got {self.threads_per_node}")
        if self.max_restarts < 0 or self.restart_backoff_s <= 0:
            raise ValueError("--max-restarts must be >= 0 and the restart backoff > 0")
        if self.startup_timeout_s <= 0 or self.stop_grace_s <= 0:
            raise ValueError("--startup-timeout-s and --stop-grace-s must be positive")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("--local-prefill-max-tokens must be >= 0")
        if self.slo_ttft_s is not None and not self.slo_ttft_s > 0:
            raise ValueError("--slo-ttft-ms must be > 0 (or 0: no objective)")
        if self.slo_tpot_s is not None and not self.slo_tpot_s > 0:
            raise ValueError("--slo-tpot-ms must be > 0 (or 0: no objective)")
        if self.pin_cores:
            self.node_cpus()  # enough cores for every node, or a clear error now

    def roles(self) -> list[str]:
        if self.colocated:
            return ["both"] * self.colocated
        return ["prefill"] * self.prefill + ["decode"] * self.decode

    def node_cpus(self) -> list[frozenset[int] | None]:
        """Each node's CPU set, in `roles()` order: None (inherit ours) unless `pin_cores`."""
        nodes = len(self.roles())
        if not self.pin_cores:
            return [None] * nodes
        if not hasattr(os, "sched_getaffinity"):
            raise ValueError("--pin-cores needs CPU affinity (Linux)")
        ours = sorted(os.sched_getaffinity(0))
        t = self.threads_per_node
        if nodes * t > len(ours):
            raise ValueError(
                f"--pin-cores needs {nodes} nodes x {t} threads = {nodes * t} cores; "
                f"this process may use {len(ours)} ({_cpu_list(ours)})"
            )
        return [frozenset(ours[i * t : (i + 1) * t]) for i in range(nodes)]


async def supervise(cfg: UpConfig, nodes: list[NodeProcess], poll_s: float = 0.5) -> None:
    """Restart every node that exits on its own (a crash, a SIGKILL, an engine that died and
    made it exit), on the same address and flags, after a backoff that doubles per restart
    of that node; after `cfg.max_restarts` restarts a node is left down. The proxy takes a
    restarted node back when its /health answers 200 again. Runs until cancelled."""
    while True:
        await asyncio.sleep(poll_s)
        for node in nodes:
            if node.stopping or not node.exited():
                continue
            if node.restarts >= cfg.max_restarts:
                node.stopping = True  # given up: not looked at again
                log.error(
                    "%s exited with %s and was restarted %d times already: leaving it down",
                    node.name, node.returncode, node.restarts,
                )  # fmt: skip
                continue
            delay = min(30.0, cfg.restart_backoff_s * 2**node.restarts)
            node.restarts += 1
            log.warning(
                "%s exited with %s; restarting it in %.1f s (restart %d of at most %d)",
                node.name, node.returncode, delay, node.restarts, cfg.max_restarts,
            )  # fmt: skip
            await asyncio.sleep(delay)
            await node.start()
            try:
                await node.wait_ready(cfg.startup_timeout_s)
            except LaunchError as e:
                log.error("restarting %s failed: %s", node.name, e)
                continue
            log.warning("%s restarted (pid %s)", node.name, node.pid)


def _cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def plan_nodes(cfg: UpConfig, log_dir: Path, cluster_token: str | None = None) -> list[NodeProcess]:
    env = {CLUSTER_TOKEN_ENV: cluster_token} if cluster_token is not None else {}
    nodes = []
    counts: dict[str, int] = {}
    for role, cpus in zip(cfg.roles(), cfg.node_cpus(), strict=True):
        index = counts[role] = counts.get(role, -1) + 1
        name = f"{role}-{index}"
        argv = [sys.executable, "-m", "common.cli", "node", "--role", role]
        argv += ["--host", NODE_HOST, "--port", "0", "--model", cfg.model]
        argv += ["--threads", str(cfg.threads_per_node)]
        if cfg.kv_backend:
            argv += ["--kv-backend", cfg.kv_backend]
        argv += list(cfg.node_args)
        argv += {"prefill": cfg.prefill_node_args, "decode": cfg.decode_node_args}.get(role, ())
        nodes.append(NodeProcess(name, role, argv, "", log_dir / f"{name}.log", cpus, env))
    return nodes


async def start_service(
    cfg: UpConfig, nodes: list[NodeProcess], cluster_token: str | None = None
) -> RunningProxy:
    """Start every node, wait until each is ready, then the proxy in front of them."""
    for node in nodes:
        await node.start()
    await asyncio.gather(*(node.wait_ready(cfg.startup_timeout_s) for node in nodes))
    urls = {role: tuple(n.url for n in nodes if n.role == role) for role in ("prefill", "decode")}
    settings = ProxySettings(
        model=cfg.model,
        host=cfg.host,
        port=cfg.port,
        prefill=urls["prefill"],
        decode=urls["decode"],
        colocated=tuple(n.url for n in nodes if n.role == "both"),
        mode="colocated" if cfg.colocated else "disagg",
        lease_s=cfg.lease_s,
        max_active_requests=cfg.max_active_requests,
        edge_queue_capacity=cfg.edge_queue_capacity,
        edge_deadline_s=cfg.edge_deadline_s,
        interstage_capacity=cfg.interstage_capacity,
        prefill_backlog_s=cfg.prefill_backlog_s,
        routing=cfg.routing,
        disagg_mode=cfg.disagg_mode,
        local_prefill_max_tokens=cfg.local_prefill_max_tokens,
        slo_ttft_s=cfg.slo_ttft_s,
        slo_tpot_s=cfg.slo_tpot_s,
        kv_streaming=cfg.kv_streaming,
        silent_after_s=cfg.silent_after_s,
        timeouts=NodeTimeouts(stall_s=cfg.stall_timeout_s),
        role_drain_timeout_s=cfg.role_drain_timeout_s,
        auto_roles=cfg.auto_roles,
        planner=cfg.planner,
        cluster_token=cluster_token,
        api_key=cfg.api_key,
    )
    try:
        proxy = await start_proxy(settings)
    except OSError as e:
        raise LaunchError(f"cannot start the proxy on {cfg.host}:{cfg.port}: {e}") from None
    return proxy


def _log_traces_to(path: Path) -> None:
    """Each request's trace (one JSON line, logger pdserve.trace) to a file, not the console."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    trace_log = logging.getLogger("pdserve.trace")
    trace_log.addHandler(handler)
    trace_log.propagate = False


async def up(cfg: UpConfig) -> int:
    """Run the service until SIGINT/SIGTERM; 0 after a clean stop, 1 if it failed to start."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    _log_traces_to(log_dir / "traces.jsonl")
    token = cfg.cluster_token or _new_cluster_token(log_dir)
    nodes = plan_nodes(cfg, log_dir, token)
    proxy: RunningProxy | None = None
    collector: PacedCollector | None = None
    supervisor: asyncio.Future[None] | None = None
    startup = asyncio.ensure_future(start_service(cfg, nodes, token))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({startup, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():  # interrupted while starting
            return 0
        proxy = startup.result()
        # This process loaded torch (the flags): keep it out of GC; and it hosts the proxy,
        # whose young collections go on a timer (common/gc_pacing.py).
        collector = start_collection(GC_INTERVAL_S, proxy.parts.metrics)
        supervisor = asyncio.ensure_future(supervise(cfg, nodes))
        _print_banner(cfg, proxy, nodes, log_dir)
        if cfg.demo_prompt:
            await _demo(proxy.url, proxy.parts.model_name, cfg.demo_prompt, cfg.api_key)
        await stopped
        print("pdserve up: stopping", file=sys.stderr, flush=True)
        return 0
    except LaunchError as e:
        print(f"pdserve up: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        tasks = [t for t in (startup, stopped, supervisor) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if proxy is not None:
            await proxy.stop()
        if collector is not None:
            await collector.stop()
        await asyncio.gather(*(node.stop(cfg.stop_grace_s) for node in nodes))


def _new_cluster_token(log_dir: Path) -> str:
    """A fresh secret for this run's proxy and nodes, also written (0600) to the log dir for
    an operator's calls to /admin/* and the nodes' /state."""
    token = secrets.token_urlsafe(32)
    path = log_dir / "cluster-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _print_banner(
    cfg: UpConfig, proxy: RunningProxy, nodes: list[NodeProcess], log_dir: Path
) -> None:
    model = proxy.parts.model_name
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32, "stream": true}'
    )
    lines = [
        *(f"  {n.name:<10} {n.url}  (pid {n.pid}{_cpus_note(n.cpus)})" for n in nodes),
        f"pdserve proxy ready: {proxy.url}",
        f"node logs and request traces (traces.jsonl): {log_dir}",
        "cluster token (Bearer, for /admin/*, /debug/* and the nodes' internal endpoints): "
        + ("as given" if cfg.cluster_token else str(log_dir / "cluster-token")),
        "try:",
        f"  curl -N {proxy.url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        *(["    -H 'Authorization: Bearer <your --api-key>' \\"] if cfg.api_key else []),
        f"    -d '{body}'",
        "Ctrl-C stops the proxy and every node.",
    ]
    print("\n".join(lines), flush=True)


def _cpus_note(cpus: frozenset[int] | None) -> str:
    return "" if cpus is None else f", cpus {_cpu_list(cpus)}"


async def _demo(url: str, model: str, prompt: str, api_key: str | None = None) -> None:
    """Stream one chat completion through the proxy's OpenAI API, printing tokens as they come."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 128,
        "temperature": 0,
        "stream": True,
    }
    print(f"\ndemo: POST {url}/v1/chat/completions  (stream, user: {prompt!r})\n", flush=True)
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=5)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            headers = bearer(api_key) if api_key else {}
            async with session.post(
                f"{url}/v1/chat/completions", json=body, headers=headers
            ) as resp:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    for choice in event.get("choices", []):
                        print(choice.get("delta", {}).get("content") or "", end="", flush=True)
                    if "error" in event:
                        print(f"\n[error] {event['error'].get('message')}", flush=True)
    except (aiohttp.ClientError, TimeoutError) as e:
        print(f"demo request failed: {e}", file=sys.stderr, flush=True)
    print("\n\n(still serving; Ctrl-C stops everything)", flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    setup_logging("INFO")
    cfg = UpConfig(
        model=model_dir(args.model),
        host=args.host,
        port=args.port,
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        kv_backend=args.kv_backend,
        threads_per_node=args.threads or args.threads_per_node,
        pin_cores=args.pin_cores,
        node_args=tuple(engine_flags(args) + shlex.split(args.node_args)),
        prefill_node_args=tuple(shlex.split(args.prefill_node_args)),
        decode_node_args=tuple(shlex.split(args.decode_node_args)),
        startup_timeout_s=args.startup_timeout_s,
        stop_grace_s=args.stop_grace_s,
        max_restarts=args.max_restarts,
        cluster_token=read_secret(args.cluster_token_file, CLUSTER_TOKEN_ENV),
        api_key=args.api_key or read_secret(None, API_KEY_ENV),
        log_dir=args.log_dir,
        demo_prompt=args.demo,
        lease_s=args.lease_s,
        max_active_requests=args.max_active_requests,
        edge_queue_capacity=args.edge_queue_capacity,
        edge_deadline_s=args.edge_deadline_s,
        interstage_capacity=args.interstage_capacity,
        prefill_backlog_s=args.prefill_backlog_s,
        routing=args.routing,
        disagg_mode=args.disagg_mode,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        slo_ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
        slo_tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None,
        kv_streaming=args.kv_streaming == "on",
        stall_timeout_s=args.stall_timeout_s,
        silent_after_s=args.silent_after_s,
        role_drain_timeout_s=args.role_drain_timeout_s,
        auto_roles=args.auto_roles,
        planner=planner_config(args),
    )
    return asyncio.run(up(cfg))
