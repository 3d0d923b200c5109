"""Real node and proxy processes on loopback for end-to-end tests.

`Cluster` starts each process with `python -m common.cli ...`, waits for it to
serve, and always stops every process it started (by pid: SIGTERM, then SIGKILL)
when the `with` block ends, whether or not the test failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the test process dies without stopping us."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def state(self) -> dict[str, Any]:
        return http_json(f"{self.url}/state", timeout=5.0)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 15.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


class Cluster:
    """Starts nodes and a proxy; `close()` (or leaving the `with`) stops them all."""

    def __init__(self, model_dir: Path, kv_backend: str = "nixl", **engine: Any) -> None:
        self.model_dir = model_dir
        self.kv_backend = kv_backend
        self.engine = {"num_blocks": 256, "threads": 1, **engine}
        self.procs: list[Proc] = []
        self.proxy: Proc | None = None  # the last proxy started
        self.proxies: list[Proc] = []
        self._logdir = Path(tempfile.mkdtemp(prefix="pdserve-e2e-"))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def _spawn(self, name: str, argv: list[str], url: str, wait: bool = True) -> Proc:
        log_path = self._logdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
            )
        proc = Proc(name, url, popen, log_path, argv)
        self.procs.append(proc)
        if wait:
            self._wait_healthy(proc, 90.0)
        return proc

    def wait_all(self, timeout: float = 120.0) -> None:
        for proc in self.procs:
            self._wait_healthy(proc, timeout)

    def _wait_healthy(self, proc: Proc, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log_tail()}"
                )
            try:
                http_json(f"{proc.url}/health", timeout=2.0)
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"{proc.name} not healthy after {timeout}s:\n{proc.log_tail()}")

    def node(
        self,
        role: str,
        name: str | None = None,
        port: int | None = None,
        wait: bool = True,
        **extra: Any,
    ) -> Proc:
        port = port or free_port()
        argv = [sys.executable, "-m", "common.cli", "node", "--role", role, "--port", str(port)]
        argv += ["--model", str(self.model_dir), "--kv-backend", self.kv_backend]
        for key, value in {**self.engine, **extra}.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        name = name or f"{role}-{len(self.procs)}"
        return self._spawn(name, argv, f"http://127.0.0.1:{port}", wait)

    def restart(self, proc: Proc) -> Proc:
        """Start `proc`'s command again (same port, same URL) once it has exited."""
        proc.stop()
        self.procs.remove(proc)
        return self._spawn(proc.name, proc.argv, proc.url)

    def start_proxy(
        self,
        prefill: list[Proc] = (),
        decode: list[Proc] = (),
        colocated: list[Proc] = (),
        **extra: Any,
    ) -> Proc:
        port = free_port()
        argv = [sys.executable, "-m", "common.cli", "proxy", "--port", str(port)]
        argv += ["--model", str(self.model_dir)]
        for flag, procs in (
            ("--prefill", prefill),
            ("--decode", decode),
            ("--colocated", colocated),
        ):
            if procs:
                argv += [flag, ",".join(p.url for p in procs)]
        for key, value in extra.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        name = "proxy" if not self.proxies else f"proxy-{len(self.proxies)}"
        self.proxy = self._spawn(name, argv, f"http://127.0.0.1:{port}")
        self.proxies.append(self.proxy)
        return self.proxy

    def nodes(self) -> list[Proc]:
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
        raise AssertionError(f"nodes not back at baseline after {timeout}s: {states}")


def _at_baseline(state: dict[str, Any]) -> bool:
    b, r = state["blocks"], state["requests"]
    return b["free"] == b["total"] and not any(r.values())


class Service:
    """`pdserve up` as a user runs it (proxy in-process, nodes as its children); stopped by
    pid with SIGINT (then SIGKILL of its process group) when the `with` block ends."""

    def __init__(self, model_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._logdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_path = self._logdir / "up.log"
        argv = [sys.executable, "-m", "common.cli", "up", "--port", str(self.port)]
        argv += ["--model", str(model_dir), "--log-dir", str(self._logdir), *args]
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=_die_with_parent,
            )

    def __enter__(self) -> Service:
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"pdserve up exited:\n{self.log_path.read_text()[-3000:]}")
                try:
                    http_json(f"{self.url}/health", timeout=2.0)
                    return self
                except OSError:
                    time.sleep(0.2)
            raise TimeoutError(f"pdserve up not healthy:\n{self.log_path.read_text()[-3000:]}")
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def node_urls(self) -> list[str]:
        return [n["url"] for n in http_json(f"{self.url}/admin/nodes")["nodes"]]

    def wait_baseline(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, Any] = {}
        while time.monotonic() < deadline:
            states = {u: http_json(f"{u}/state", timeout=5.0) for u in self.node_urls()}
            if all(_at_baseline(s) for s in states.values()):
                return
            time.sleep(0.05)
        raise AssertionError(f"nodes not back at baseline after {timeout}s: {states}")
