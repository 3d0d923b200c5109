"""`pdserve bench-transfer`: KV-transfer latency and bandwidth per backend, with ceilings.

For each backend, a sender and a receiver process hold real KV cache layouts;
for each shape and transfer size the receiver asks (TransferRequest) and the
sender writes scattered, non-adjacent blocks, timing write() -> TransferDone.
The same run measures two ceilings: a plain torch memcpy of the same bytes in
the sender, and bare NIXL (one contiguous region, one descriptor, no request
bookkeeping) between the same processes, reported as backend "nixl-bare", and
again with one small zmq message to the receiver after each write ("nixl-bare+notify").

    pdserve bench-transfer [--backends nixl,ucxx,zmq] [--shapes tiny,8b]
                           [--blocks 1,8,64,512] [--reps N] [--device cpu|cuda|cuda:N]
                           [--json FILE]

--device puts both caches on that device: with cuda, nixl moves VRAM to VRAM (and bare
NIXL beside it), zmq and ucxx stage through pinned host memory, and the memcpy ceiling is a
device-to-device copy.

Backend settings come from TransferConfig.from_env (PDSERVE_KV_* variables).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from kv_transfer.bench.report import goals, markdown_table, write_plot
from kv_transfer.config import BACKENDS

WARMUP = 1
MIN_REPS = 3
POINT_BUDGET_S = 2.5  # timed reps of one point stop growing past this (the run's length)


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return self.layers * 2 * self.block_size * self.heads * self.head_dim * itemsize


# The built-in tiny model's KV shape (common.tiny.model.TinyLlamaShape, block size 16; a test
# keeps the two in step) and Llama-3-8B's.
SHAPES = {
    "tiny": lambda: Shape(4, 2, 64, 16, "float32"),
    "8b": lambda: Shape(32, 8, 128, 16, "bfloat16"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench-transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of nixl,ucxx,zmq")
    p.add_argument("--shapes", default="tiny,8b", help="comma list of tiny,8b")
    p.add_argument("--blocks", default="1,8,64,512", help="blocks per transfer, comma list")
    p.add_argument("--reps", type=int, default=200, help="timed repetitions per point (max)")
    p.add_argument("--device", default="cpu", help="where both caches live: cpu, cuda, cuda:N")
    p.add_argument("--json", type=Path, help="write the records to this file (and a .png beside)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    args.backends = _choices(args.backends, BACKENDS, "--backends", p)
    args.shapes = _choices(args.shapes, tuple(SHAPES), "--shapes", p)
    try:
        args.blocks = sorted({int(b) for b in args.blocks.split(",")})
    except ValueError:
        p.error(f"--blocks must be integers, got {args.blocks!r}")
    if args.blocks[0] < 1 or args.reps < 1:
        p.error("--blocks and --reps must be positive")
    return args


def _choices(
    value: str, allowed: tuple[str, ...], flag: str, p: argparse.ArgumentParser
) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        p.error(f"{flag}: unknown {bad or value!r}; choose from {','.join(allowed)}")
    return items


class WorkerProc:
    """A bench_worker process and its control socket; stopped by pid if it hangs."""

    def __init__(self, role: str) -> None:
        self.role = role
        # (annotated: pyzmq types Context.instance() as a Context of no socket type)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        cmd = [sys.executable, "-m", "kv_transfer.bench.worker", f"tcp://127.0.0.1:{port}"]
        quiet = {"NIXL_LOG_LEVEL": "WARN", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        self.proc = subprocess.Popen(cmd, env={**quiet, **os.environ})
        if not self._sock.poll(120_000):
            raise TimeoutError(f"bench {role} worker did not start")
        self._sock.recv()

    def send(self, op: str, **args: object) -> None:
        self._sock.send(msgpack.packb({"op": op, **args}, use_bin_type=True))

    def result(self, timeout_s: float = 600.0) -> Any:
        """The op's result, as the worker's msgpack reply carries it (its shape is per op)."""
        if not self._sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"bench {self.role} worker did not answer in {timeout_s}s")
        reply = msgpack.unpackb(self._sock.recv(), raw=False)
        if not reply["ok"]:
            raise RuntimeError(f"bench {self.role} worker: {reply['error']}")
        return reply["result"]

    def call(self, op: str, **args: object) -> Any:
        self.send(op, **args)
        return self.result()

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("exit")
                self.result(timeout_s=20)
                self.proc.wait(10)
        except (TimeoutError, RuntimeError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            self._sock.close(linger=0)


@contextmanager
def worker_pair() -> Iterator[tuple[WorkerProc, WorkerProc]]:
    workers: list[WorkerProc] = []
    try:
        workers.append(WorkerProc("sender"))
        workers.append(WorkerProc("receiver"))
        yield workers[0], workers[1]
    finally:
        for w in workers:
            w.stop()


def scattered(rng: np.random.Generator, n: int, parity: int, reps: int) -> list[list[int]]:
    """Per rep, n block ids of one parity in random order: no two are adjacent."""
    pool = np.arange(parity, 2 * n + parity, 2)
    return [rng.permutation(pool).tolist() for _ in range(reps)]


def run_point(
    sender: WorkerProc, receiver: WorkerProc, peers: dict, n: int, reps: int, tag: str
) -> dict:
    rng = np.random.default_rng(n)
    rids = [f"{tag}-{i}" for i in range(reps)]
    src, dst = scattered(rng, n, 0, reps), scattered(rng, n, 1, reps)
    receiver.send("recv_point", peer=peers["sender"], rids=rids, dst=dst)
    sent: dict[str, list[float]] = sender.call(
        "send_point", peer=peers["receiver"], rids=rids, src=src
    )
    landed: list[float] = receiver.result()
    ok: bool = receiver.call("verify", src=src[-1], dst=dst[-1])
    recv = [t - s for t, s in zip(landed, sent["starts"], strict=True)]
    return {"lat": sent["lat"], "recv": recv, "verified": ok}


def record(
    backend: str,
    shape: str,
    s: Shape,
    n: int,
    lat: list[float],
    memcpy: list[float],
    **extra: object,
) -> dict:
    nbytes = n * s.block_bytes
    p50 = float(np.median(lat))
    return {
        "backend": backend,
        "shape": shape,
        "num_blocks": n,
        "bytes": nbytes,
        "p50_us": round(p50 * 1e6, 1),
        "p99_us": round(float(np.percentile(lat, 99)) * 1e6, 1),
        "gbps": round(nbytes / p50 / 1e9, 3),
        "memcpy_gbps": round(nbytes / float(np.median(memcpy)) / 1e9, 3),
        "reps": len(lat),
        "block_bytes": s.block_bytes,
        **extra,
    }


def bench_shape(
    sender: WorkerProc, receiver: WorkerProc, backend: str, shape: str, args: argparse.Namespace
) -> list[dict]:
    """Every size for one shape. For nixl, each point is followed at once by its bare
    ceiling, so that both see the same background load."""
    s = SHAPES[shape]()
    peers = setup_pair(sender, receiver, backend, s, 2 * max(args.blocks) + 1, args.device)
    bare: dict | None = receiver.call("bare_target") if backend == "nixl" else None
    records = []
    for n in args.blocks:
        rec = layer_point(sender, receiver, peers, backend, shape, s, n, args.reps)
        rec["device"] = args.device
        records.append(rec)
        p50, gbps = rec["p50_us"], rec["gbps"]
        print(
            f"  {backend:5} {shape:4} {n:4} blocks: p50 {p50:9.1f} us {gbps:6.2f} GB/s", flush=True
        )
        if bare is not None:
            records.append(bare_point(sender, shape, s, n, rec["reps"], bare, with_notify=False))
            records.append(bare_point(sender, shape, s, n, rec["reps"], bare, with_notify=True))
    for w in (sender, receiver):
        w.call("teardown")
    return records


def setup_pair(
    sender: WorkerProc,
    receiver: WorkerProc,
    backend: str,
    s: Shape,
    num_blocks: int,
    device: str = "cpu",
) -> dict:
    peers: dict[str, str] = {}
    for role, w in (("sender", sender), ("receiver", receiver)):
        info: dict[str, str] = w.call(
            "setup", backend=backend, shape=asdict(s), num_blocks=num_blocks, role=role,
            device=device,
        )  # fmt: skip
        peers[role] = info["name"]
        peers[f"{role}_address"] = info["address"]
    receiver.call("connect", address=peers["sender_address"])
    return peers


def layer_point(
    sender: WorkerProc,
    receiver: WorkerProc,
    peers: dict,
    backend: str,
    shape: str,
    s: Shape,
    n: int,
    max_reps: int,
) -> dict:
    probe = run_point(sender, receiver, peers, n, WARMUP, f"{shape}-{n}-warm")
    budget_reps = POINT_BUDGET_S / max(float(np.median(probe["lat"])), 1e-6)
    reps = int(np.clip(budget_reps, MIN_REPS, max_reps))
    point = run_point(sender, receiver, peers, n, reps, f"{shape}-{n}")
    memcpy: list[float] = sender.call("memcpy", nbytes=n * s.block_bytes, reps=max(reps, MIN_REPS))
    recv_p50 = round(float(np.median(point["recv"])) * 1e6, 1)
    return record(
        backend, shape, s, n, point["lat"], memcpy, recv_p50_us=recv_p50, verified=point["verified"]
    )


def bare_point(
    sender: WorkerProc, shape: str, s: Shape, n: int, reps: int, target: dict, with_notify: bool
) -> dict:
    """Bare NIXL ("nixl-bare"), or bare NIXL plus one zmq message to the receiver per write
    ("nixl-bare+notify": the floor for a write whose receiver is told over a socket)."""
    nbytes = n * s.block_bytes
    times: list[float] = sender.call(
        "bare_point", nbytes=nbytes, reps=reps + WARMUP, with_notify=with_notify, **target
    )
    memcpy: list[float] = sender.call("memcpy", nbytes=nbytes, reps=max(reps, MIN_REPS))
    label = "nixl-bare+notify" if with_notify else "nixl-bare"
    return record(label, shape, s, n, times[WARMUP:], memcpy)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    records: list[dict] = []
    for backend in args.backends:
        with worker_pair() as (sender, receiver):
            for shape in args.shapes:
                records += bench_shape(sender, receiver, backend, shape, args)
    print()
    print(markdown_table(records))
    print()
    print(goals(records))
    png = args.json.with_suffix(".png") if args.json else Path("bench_transfer.png")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
        print(f"records: {args.json}")
    write_plot(records, png)
    print(f"plot: {png}  (run took {time.monotonic() - started:.0f}s)")
    unverified = [r for r in records if r.get("verified") is False]
    for r in unverified:
        print(f"ERROR: {r['backend']} {r['shape']} {r['num_blocks']} blocks: bytes did not match")
    return 1 if unverified else 0


if __name__ == "__main__":
    sys.exit(main())
