"""One node child of `pdserve up` (`NodeProcess`): started in its own session with a
parent-death signal and, if given, bound to its cores before exec; its output copied to a
log file (the last lines kept, the ready line read for its URL); stopped by pid, SIGTERM then
SIGKILL."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import IO

import aiohttp

log = logging.getLogger(__name__)

NODE_HOST = "127.0.0.1"
READY_PREFIX = b"pdserve node ready:"


class LaunchError(Exception):
    """The service could not start; the message says which part and why."""


class NodeProcess:
    """One node child: started (on `cpus` if given), watched (its output copied to a log file,
    the last lines kept), and stopped by pid."""

    def __init__(
        self,
        name: str,
        role: str,
        argv: list[str],
        url: str,
        log_path: Path,
        cpus: frozenset[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """url: where it serves; "" until its ready line names it (started on port 0)."""
        self.name, self.role, self.argv, self.url, self.log_path = name, role, argv, url, log_path
        self.cpus = cpus
        self.env = env or {}  # added to ours (secrets go here, never on the command line)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.ready = False
        self.stopping = False
        self.restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exited(self) -> bool:
        return self._proc is not None and self._proc.returncode is not None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    async def start(self) -> None:
        self.ready = False
        log_file = open(self.log_path, "ab" if self.restarts else "wb")  # closed by the pump
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            start_new_session=True,
            preexec_fn=functools.partial(_child_setup, self.cpus),
            limit=2**20,
        )
        self._pump = asyncio.get_running_loop().create_task(self._copy_output(log_file))

    async def _copy_output(self, log_file: IO[bytes]) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with log_file:
            async for line in self._proc.stdout:
                log_file.write(line)
                log_file.flush()
                self.tail.append(line.decode(errors="replace").rstrip())
                if not self.ready and line.startswith(READY_PREFIX):
                    self._bound(line[len(READY_PREFIX) :].decode(errors="replace"))
        code = await self._proc.wait()
        if not self.stopping and self.ready:
            log.error("%s exited with %s; last lines:\n%s", self.name, code, self.log_tail())

    def _bound(self, rest: str) -> None:
        """The ready line names the URL it serves; a node started on port 0 keeps the port
        it was given, so that a restart comes back at the same address."""
        self.ready = True
        if not self.url:
            self.url = rest.split()[0]
            self.argv = pin_port(self.argv, int(self.url.rsplit(":", 1)[1]))

    def log_tail(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail)

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the ready line or a 200 from /health; LaunchError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            while not self.ready:
                if self._proc is not None and self._proc.returncode is not None:
                    await self._drain_output()
                    raise LaunchError(self._failure(f"exited with status {self._proc.returncode}"))
                if time.monotonic() > deadline:
                    raise LaunchError(self._failure(f"was not ready after {timeout_s:g} s"))
                if self.url and await _health_ok(session, self.url):
                    break
                await asyncio.sleep(0.25)
        self.ready = True

    async def _drain_output(self) -> None:
        """Let the pump copy the last of the output (a dead child's pipe ends at once)."""
        if self._pump is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._pump), 5.0)

    def _failure(self, what: str) -> str:
        where = f"node {self.name} ({self.url})"
        return f"{where} {what}; its log {self.log_path} ends:\n{self.log_tail()}"

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; waits until it is gone."""
        self.stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                log.warning("%s did not stop within %g s; killing it", self.name, grace_s)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        await self._drain_output()


async def _health_ok(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def _child_setup(cpus: frozenset[int] | None) -> None:
    """In the child, before exec: SIGTERM it when this process dies (Linux only), and bind it
    to `cpus` (threads started after exec, torch's included, inherit the binding)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def free_port(host: str = NODE_HOST) -> int:
    """A port free now (bound to 0, then released); a race with other processes remains, so
    nodes are started on port 0 instead and name their port on their ready line."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pin_port(argv: list[str], port: int) -> list[str]:
    """`argv` with its `--port` value replaced by `port`."""
    i = argv.index("--port")
    return [*argv[: i + 1], str(port), *argv[i + 2 :]]
