"""Real node and proxy processes on loopback for end-to-end tests (built on procs).

`Cluster` starts each process with `python -m common.cli ...`, waits for it to serve, and
always stops every process it started (by pid: SIGTERM, then SIGKILL) on `close()` or when
the `with` block ends, whether or not the test failed. `Service` is `pdserve up` as a user
runs it.
"""

from __future__ import annotations

import secrets
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.wire.auth import CLUSTER_TOKEN_ENV, bearer
from tests.support import procs
from tests.support.http import http_json

Topology = tuple[int, int, int]  # prefill, decode, colocated nodes


NODE_READY = "pdserve node ready:"
PROXY_READY = "pdserve proxy ready:"


@dataclass
class Server(procs.Proc):
    """A node or proxy process and the URL it serves. Started on port 0, it names its URL on
    its ready line (`ready_prefix`); `url` is "" until then (see `wait_serving`)."""

    url: str = ""
    auth: dict[str, str] = field(default_factory=dict)  # the cluster token's header, if any
    ready_prefix: str = NODE_READY

    def state(self) -> dict[str, Any]:
        return http_json(f"{self.url}/state", timeout=5.0, headers=self.auth)

    def wait_serving(self, timeout: float) -> None:
        """Until its ready line names its URL and /health answers 200. The port it was given
        is pinned in its command line, so that a restart comes back at the same URL."""
        if not self.url:
            self.url = procs.wait_announced(self, self.ready_prefix, timeout)
            i = self.argv.index("--port")
            self.argv[i + 1] = self.url.rsplit(":", 1)[1]
        procs.wait_healthy(self, self.url, timeout)


class Cluster:
    """Starts nodes and a proxy; `close()` (or leaving the `with`) stops them all."""

    def __init__(
        self, model_dir: Path, kv_backend: str = "nixl", token: str | None = None, **engine: Any
    ) -> None:
        """token: the cluster token every process gets ($PDSERVE_CLUSTER_TOKEN); None: open."""
        self.model_dir = model_dir
        self.kv_backend = kv_backend
        self.token = token
        self.auth = bearer(token) if token else {}
        self.engine = {"num_blocks": 256, "threads": 1, **engine}
        self.procs: list[Server] = []
        self.proxy: Server | None = None  # the last proxy started
        self.proxies: list[Server] = []
        self._logdir = Path(tempfile.mkdtemp(prefix="pdserve-e2e-"))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        procs.stop_all(self.procs)

    def _spawn(self, name: str, argv: list[str], ready: str, wait: bool = True) -> Server:
        env = procs.child_env(**{CLUSTER_TOKEN_ENV: self.token}) if self.token else None
        log = self._logdir / f"{name}.log"
        proc = procs.spawn(name, argv, log, env=env, cls=Server, ready_prefix=ready, auth=self.auth)
        self.procs.append(proc)
        if wait:
            proc.wait_serving(90.0)
        return proc

    def wait_all(self, timeout: float = 120.0) -> None:
        for proc in self.procs:
            proc.wait_serving(timeout)

    def node(
        self,
        role: str,
        name: str | None = None,
        port: int = 0,
        wait: bool = True,
        **extra: Any,
    ) -> Server:
        """A node on `port` (0: the port it binds, named on its ready line); with `wait`,
        once it serves (else call `wait_all` before using its `url`)."""
        argv = procs.module("common.cli", "node", "--role", role, "--port", str(port))
        argv += ["--model", str(self.model_dir), "--kv-backend", self.kv_backend]
        for key, value in {**self.engine, **extra}.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        name = name or f"{role}-{len(self.procs)}"
        return self._spawn(name, argv, NODE_READY, wait)

    def restart(self, proc: Server) -> Server:
        """Start `proc`'s command again (same port, same URL) once it has exited."""
        proc.stop()
        new = procs.respawn(proc)
        self.procs[self.procs.index(proc)] = new
        new.wait_serving(90.0)
        return new

    def start_proxy(
        self,
        prefill: list[Server] = (),
        decode: list[Server] = (),
        colocated: list[Server] = (),
        **extra: Any,
    ) -> Server:
        argv = procs.module("common.cli", "proxy", "--port", "0")
        argv += ["--model", str(self.model_dir)]
        for flag, nodes in (
            ("--prefill", prefill),
            ("--decode", decode),
            ("--colocated", colocated),
        ):
            if nodes:
                argv += [flag, ",".join(p.url for p in nodes)]
        for key, value in extra.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        name = "proxy" if not self.proxies else f"proxy-{len(self.proxies)}"
        self.proxy = self._spawn(name, argv, PROXY_READY)
        self.proxies.append(self.proxy)
        return self.proxy

    def nodes(self) -> list[Server]:
        return [p for p in self.procs if p not in self.proxies]

    def wait_baseline(self, timeout: float = 10.0) -> None:
        """Every live node: all blocks free and no request left."""
        deadline = time.monotonic() + timeout
        states: dict[str, Any] = {}
        while time.monotonic() < deadline:
            states = {}
            for p in self.nodes():
                if not p.alive():
                    continue
                try:
                    states[p.name] = p.state()
                except OSError as e:
                    raise AssertionError(f"{p.name} at {p.url}: {e}\n{p.log_tail()}") from e
            if all(_at_baseline(s) for s in states.values()):
                return
            time.sleep(0.05)
        raise AssertionError(
            f"nodes not back at baseline after {timeout}s (cached free blocks count as free): "
            f"{states}"
        )


def start_cluster(
    model_dir: Path,
    topology: Topology,
    token: str | None = None,
    proxy_args: dict[str, Any] | None = None,
    **engine: object,
) -> Cluster:
    """A cluster of `topology` nodes behind one proxy (its extra flags: `proxy_args`), every
    node started at once; if any fails to come up, everything started is stopped before the
    error propagates."""
    cluster = Cluster(model_dir, token=token, **engine)
    try:
        n_p, n_d, n_c = topology
        prefill = [cluster.node("prefill", f"prefill-{i}", wait=False) for i in range(n_p)]
        decode = [cluster.node("decode", f"decode-{i}", wait=False) for i in range(n_d)]
        both = [cluster.node("both", f"both-{i}", wait=False) for i in range(n_c)]
        cluster.wait_all()
        cluster.start_proxy(prefill=prefill, decode=decode, colocated=both, **(proxy_args or {}))
    except BaseException:
        cluster.close()
        raise
    return cluster


def _at_baseline(state: dict[str, Any]) -> bool:
    """No request left and every block free. Blocks the prefix cache keeps (no reference,
    still reusable) count as free, as the node counts them: `prefix_cache.cached_free` of
    them may be holding cached KV, and none may be shared (referenced twice) any more."""
    b, r = state["blocks"], state["requests"]
    shared = (state.get("prefix_cache") or {}).get("shared", 0)
    return b["free"] == b["total"] and not any(r.values()) and not shared


class Service:
    """`pdserve up` as a user runs it (proxy in-process, nodes as its children); stopped by
    pid with SIGINT (then SIGKILL; its nodes get their parent-death signal) when the `with`
    block ends."""

    def __init__(self, model_dir: Path, *args: str) -> None:
        self.url = ""  # named on its ready line: it binds port 0
        self._logdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_path = self._logdir / "up.log"
        # `pdserve up` guards internal endpoints with a cluster token; the test knows it.
        self.token = secrets.token_urlsafe(24)
        self.auth = bearer(self.token)
        argv = procs.module("common.cli", "up", "--port", "0")
        argv += ["--model", str(model_dir), "--log-dir", str(self._logdir), *args]
        env = procs.child_env(**{CLUSTER_TOKEN_ENV: self.token})
        self.proc = procs.spawn("pdserve-up", argv, self.log_path, env=env)

    def __enter__(self) -> Service:
        try:
            self.url = procs.wait_announced(self.proc, PROXY_READY, 180.0)
            procs.wait_healthy(self.proc, self.url, 180.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int | None:
        return self.proc.stop(signal.SIGINT, grace=60.0)

    def node_urls(self) -> list[str]:
        return [n["url"] for n in http_json(f"{self.url}/admin/nodes", headers=self.auth)["nodes"]]

    def wait_baseline(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, Any] = {}
        while time.monotonic() < deadline:
            states = {
                u: http_json(f"{u}/state", timeout=5.0, headers=self.auth) for u in self.node_urls()
            }
            if all(_at_baseline(s) for s in states.values()):
                return
            time.sleep(0.05)
        raise AssertionError(
            f"nodes not back at baseline after {timeout}s (cached free blocks count as free): "
            f"{states}"
        )
