"""Test-side handles on KV agent node processes (kv_agent_node.py), and event helpers.

Each `AgentNode` is a process started through `procs` and driven over a zmq PAIR socket.
Its owner (a fixture) stops it in a finally block: asked to exit, then killed by pid if it
does not within a few seconds.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import zmq

from tests.support import procs

# Short liveness settings so hung-peer detection stays well inside the tests' waits.
TEST_CONFIG = {
    "heartbeat_interval_s": 0.2,
    "peer_timeout_s": 3.0,
    "handshake_timeout_s": 10.0,
    "close_timeout_s": 3.0,
    # These tests drive the sender directly (push mode: write() with no request_transfer()
    # from the receiver); the strict default is tested in test_kv_agent_api.py.
    "accept_unsolicited_writes": True,
}
TERMINAL = ("TransferDone", "TransferFailed", "KVReceived", "Quiescent")
ENV = {"OMP_NUM_THREADS": "1", "UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARN"}


class NodeError(RuntimeError):
    """An operation failed inside the node process (message carries its error)."""


class AgentNode:
    """One process hosting a KVTransferAgent; `call(op, ...)` runs an operation in it."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        self._sock = zmq.Context.instance().socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        argv = procs.module("tests.support.kv_agent_node", f"tcp://127.0.0.1:{port}")
        self.proc = procs.spawn(
            name,
            argv,
            log_dir / f"{name}.log",
            env=procs.child_env(**ENV),
            death_signal=signal.SIGKILL,
        )

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the process says it is ready on the control socket."""

        def said_ready() -> bool:
            if not self._sock.poll(200):
                return False
            self._sock.recv()
            return True

        try:
            procs.wait_ready(self.proc, said_ready, timeout, what="started", poll_s=0.0)
        except RuntimeError as e:  # it exited
            raise NodeError(str(e)) from None

    def call(self, op: str, timeout: float = 60.0, **args: object) -> object:
        if not self._sock.poll(int(timeout * 1000), zmq.POLLOUT):  # never block forever
            raise TimeoutError(f"{self.name}: cannot send {op} (process gone?)\n{self.log_tail()}")
        self._sock.send(msgpack.packb({"op": op, **args}, use_bin_type=True), zmq.NOBLOCK)
        if not self._sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"{self.name}: {op} took over {timeout}s\n{self.log_tail()}")
        reply = msgpack.unpackb(self._sock.recv(), raw=False)
        if not reply["ok"]:
            raise NodeError(f"{self.name}: {op}: {reply['error']}\n{reply.get('tb', '')}")
        return reply["result"]

    def start(self, backend: str, engine_id: str, cache: dict, **extra: object) -> dict:
        config = {**TEST_CONFIG, **extra.pop("config", {})}  # type: ignore[dict-item]
        return self.call(  # type: ignore[return-value]
            "start", backend=backend, engine_id=engine_id, cache=cache, config=config, **extra
        )

    def events(self, wait: float = 0.0) -> list[dict]:
        return self.call("events", timeout=wait + 30, wait=wait)  # type: ignore[return-value]

    def kill(self) -> None:
        """SIGKILL, by pid (the tests' way to make a peer vanish mid-transfer)."""
        self.proc.kill()

    def stop(self) -> None:
        """Ask the process to exit (its agent closes), then SIGKILL it by pid if needed."""
        try:
            if self.proc.alive():
                self.call("exit", timeout=15)
                self.proc.wait(10)
        except (TimeoutError, NodeError, subprocess.TimeoutExpired, zmq.ZMQError):
            pass
        finally:
            self.proc.stop(signal.SIGKILL, grace=10)
            self._sock.close(linger=0)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.proc.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def start_nodes(names: list[str], log_dir: Path) -> list[AgentNode]:
    """Start processes in parallel; on any failure stop the ones already started."""
    nodes: list[AgentNode] = []
    try:
        for name in names:
            nodes.append(AgentNode(name, log_dir))
        for node in nodes:
            node.wait_ready()
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def collect(
    node: AgentNode,
    until: Callable[[list[dict]], bool],
    timeout: float,
    into: list[dict] | None = None,
) -> list[dict]:
    """Gather node events until `until(events)` holds or `timeout` passes."""
    events = [] if into is None else into
    deadline = time.monotonic() + timeout
    while not until(events):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        events.extend(node.events(wait=min(0.5, left)))
    return events


def terminal(events: list[dict], kind: str | None = None) -> list[dict]:
    return [e for e in events if e["kind"] in TERMINAL and (kind is None or e["kind"] == kind)]


def count_terminal(n: int) -> Callable[[list[dict]], bool]:
    return lambda events: len(terminal(events)) >= n


def messages(events: list[dict], message_type: str) -> list[dict]:
    return [
        e for e in events if e["kind"] == "MessageReceived" and e["message_type"] == message_type
    ]


@dataclass(frozen=True)
class CacheSpec:
    num_blocks: int
    layers: int
    heads: int
    dim: int
    block_size: int
    dtype: str = "float32"

    @property
    def block_bytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return self.layers * 2 * self.block_size * self.heads * self.dim * itemsize

    def as_dict(self, **extra: object) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "layers": self.layers,
            "heads": self.heads,
            "dim": self.dim,
            "block_size": self.block_size,
            "dtype": self.dtype,
            **extra,
        }


def read_shm(path: Path, spec: CacheSpec) -> np.ndarray:
    """A dead node's cache from its shared-memory file: [num_blocks, block_bytes] uint8."""
    return np.fromfile(path, dtype=np.uint8).reshape(spec.num_blocks, spec.block_bytes)


def start_pair(
    prefill: AgentNode,
    decode: AgentNode,
    backend: str,
    p_spec: CacheSpec,
    d_spec: CacheSpec,
    p_config: dict | None = None,
    d_shm: Path | None = None,
    d_config: dict | None = None,
) -> tuple[dict, dict]:
    """Fresh agents on both nodes; decode connects to prefill (it learns the address
    from the KVHandle in the real flow). Returns both start() results ({address, name})."""
    p = prefill.start(backend, "prefill", p_spec.as_dict(), config=p_config or {})
    d_cache = d_spec.as_dict(shm_path=str(d_shm) if d_shm else None)
    d = decode.start(backend, "decode", d_cache, config=d_config or {})
    assert decode.call("connect", address=p["address"]) == p["name"]
    return p, d
