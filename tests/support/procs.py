"""Child processes for tests: start one, wait until it is ready, stop it by pid.

Every process a test starts goes through here: `spawn` for one that runs alongside the test
(a node, a proxy, `pdserve up`, a KV agent node), `run` for a command run to its end (a CLI
call, a script). Children

- run from the repository root with the root first on PYTHONPATH, so they import this
  checkout's code whether started with `-m` or by script path (not the code an editable
  install elsewhere points at), with unbuffered output;
- get a parent-death signal (Linux prctl), so none outlives a test process that is killed;
- are stopped by pid: `Proc.stop()` sends SIGTERM (or the signal given), waits `grace`
  seconds, then SIGKILLs. Whoever spawns a process stops it in a `finally` (`stop_all` for
  several); `reap_all()` is the session's safety net and names anything that was missed.

Tests that spawn processes are marked `e2e` (see tests/conftest.py, which makes any other
test fail at its first attempt to start one).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from tests.support.http import http_json

ROOT = Path(__file__).resolve().parents[2]

P = TypeVar("P", bound="Proc")

_started: list[Proc] = []  # every spawned process, for reap_all()


def python(*args: str) -> list[str]:
    """argv running this interpreter: `python(script, ...)` or `python("-c", code)`."""
    return [sys.executable, *args]


def module(name: str, *args: str) -> list[str]:
    """argv running `python -m name args...`."""
    return [sys.executable, "-m", name, *args]


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a child: `base` (default: ours), unbuffered output, the repository
    root first on PYTHONPATH, then `extra`."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _death_signal(sig: int) -> Callable[[], None]:
    def set_it() -> None:  # in the child, before exec
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG

    return set_it


@dataclass
class Proc:
    """A spawned process, its command line and its log (stdout and stderr together)."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict, repr=False)
    death_signal: int = signal.SIGTERM

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def send_signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        """Its exit status; subprocess.TimeoutExpired if it runs past `timeout`."""
        return self.popen.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 15.0) -> int | None:
        """Send `sig` by pid, wait up to `grace` s, then SIGKILL; its exit status."""
        if self.alive():
            os.kill(self.pid, sig)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL by pid and reap."""
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(10)


def _popen(
    argv: list[str], log_path: Path, mode: str, env: dict[str, str], death_signal: int
) -> subprocess.Popen[bytes]:
    with open(log_path, mode) as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            preexec_fn=_death_signal(death_signal),
        )


def spawn(
    name: str,
    argv: list[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    death_signal: int = signal.SIGTERM,
    cls: type[P] = Proc,  # type: ignore[assignment]
    **attrs: object,
) -> P:
    """Start `argv` from the repository root, output to `log_path`; `cls(..., **attrs)`.

    `env` is the child's whole environment (default: `child_env()`). The child gets
    `death_signal` when the thread that started it ends, so start processes from the
    test's thread, never from a worker thread."""
    full_env = child_env() if env is None else dict(env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    popen = _popen(argv, log_path, "wb", full_env, death_signal)
    proc = cls(
        name=name,
        argv=list(argv),
        popen=popen,
        log_path=log_path,
        env=full_env,
        death_signal=death_signal,
        **attrs,
    )
    _started.append(proc)
    return proc


def respawn(proc: P) -> P:
    """`proc`'s command again, with its environment and log (appended), once it exited."""
    if proc.alive():
        raise RuntimeError(f"{proc.name} (pid {proc.pid}) is still running")
    popen = _popen(proc.argv, proc.log_path, "ab", proc.env, proc.death_signal)
    new = type(proc)(**{**proc.__dict__, "popen": popen})
    _started.append(new)
    return new


def wait_ready(
    proc: Proc, ready: Callable[[], bool], timeout: float, what: str = "ready", poll_s: float = 0.1
) -> None:
    """Poll `ready()` until it holds. Raises RuntimeError (with the log's tail) if `proc`
    exits first, TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(
                f"{proc.name} exited with {proc.returncode} before it was {what}:\n"
                f"{proc.log_tail()}"
            )
        if ready():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{proc.name} not {what} after {timeout:g} s:\n{proc.log_tail()}")


def wait_announced(proc: Proc, prefix: str, timeout: float) -> str:
    """The first word after `prefix` on the first log line that starts with it (a server
    started on port 0 names its URL on its ready line), waiting for it as `wait_ready`."""
    found: list[str] = []

    def announced() -> bool:
        try:
            text = proc.log_path.read_text(errors="replace")
        except OSError:
            return False
        for line in text.splitlines():
            if line.startswith(prefix) and line[len(prefix) :].split():
                found.append(line[len(prefix) :].split()[0])
                return True
        return False

    wait_ready(proc, announced, timeout, what=f"announced ({prefix!r})")
    return found[0]


def wait_healthy(proc: Proc, url: str, timeout: float) -> None:
    """Wait until `url`/health answers 200 (see wait_ready)."""

    def healthy() -> bool:
        try:
            http_json(f"{url}/health", timeout=2.0)
        except OSError:
            return False
        return True

    wait_ready(proc, healthy, timeout, what="healthy")


def stop_all(procs: Iterable[Proc], sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
    """Stop every process, the last started first; each is stopped even if one fails."""
    errors: list[BaseException] = []
    for proc in reversed(list(procs)):
        try:
            proc.stop(sig, grace)
        except BaseException as e:  # stop the others, then report the first
            errors.append(e)
    if errors:
        raise errors[0]


def reap_all() -> list[str]:
    """SIGKILL every spawned process still running; their names (a leak to report)."""
    leaked = [f"{p.name} (pid {p.pid})" for p in _started if p.alive()]
    for proc in _started:
        if proc.alive():
            proc.kill()
    _started.clear()
    return leaked


def run(
    argv: list[str],
    *,
    timeout: float,
    check: bool = False,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` to its end from the repository root and capture its output as text; `env`
    is its whole environment (default: `child_env()`). On `timeout` (or any error while
    waiting) the child is killed and reaped, then the exception is raised; `check` raises
    CalledProcessError on a non-zero status."""
    return subprocess.run(
        argv,
        cwd=ROOT,
        env=child_env() if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        preexec_fn=_death_signal(signal.SIGKILL),
    )
