"""One side of `pdserve bench-transfer`: a process with a real KV cache and an agent.

    python -m kv_transfer.bench.worker <control endpoint>

Driven by kv_transfer.bench.main over a zmq PAIR socket with msgpack requests
{"op": ..., ...}, answered {"ok": true, "result": ...} / {"ok": false, "error": ...}.
A measured point runs entirely inside the two workers (receiver asks, sender
writes), so the driver's own latency never enters a timing.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import torch
import zmq

from common.wire.fingerprint import Fingerprint
from common.wire.messages import TransferRequest
from kv_transfer import (
    KVReceived,
    KVTransferAgent,
    MessageReceived,
    TransferConfig,
    TransferDone,
    TransferEvent,
)
from kv_transfer.layout import CacheLayout

if TYPE_CHECKING:  # nixl ships no type information: to mypy this name is Any
    from nixl._api import nixl_agent

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_NOTIFICATION = b"\x00" * 48  # about a sealed-less KVDone's size
_WAIT_S = 120.0


def pattern_byte(block_ids: np.ndarray) -> np.ndarray:
    """The byte every byte of source block b holds (cheap to fill, to check)."""
    return ((block_ids.astype(np.int64) * 7 + 1) % 251).astype(np.uint8)


class Events:
    """The agent's events, kept until someone waits for them (none is dropped)."""

    def __init__(self, agent: KVTransferAgent) -> None:
        self.agent = agent
        self.pending: list[TransferEvent] = []

    def wait_for(self, match: Callable[[TransferEvent], bool]) -> TransferEvent:
        deadline = time.monotonic() + _WAIT_S
        while time.monotonic() < deadline:
            for i, ev in enumerate(self.pending):
                if match(ev):
                    return self.pending.pop(i)
            self.pending.extend(self.agent.wait_events(1.0))
        raise TimeoutError("bench worker: awaited event never came")

    def wait_request(self, request_id: str) -> TransferRequest:
        """The receiver's TransferRequest for request_id."""
        ev = self.wait_for(lambda e: _is_request(e, request_id))
        assert isinstance(ev, MessageReceived) and isinstance(ev.message, TransferRequest)
        return ev.message


class Worker:
    def __init__(self) -> None:
        self.agent: KVTransferAgent | None = None
        self.cache: torch.Tensor | None = None
        self.bare: dict[str, Any] = {}  # the bare NIXL agent, its peer, progress thread
        self.ops: dict[str, Callable[[dict], object]] = {
            "setup": self.setup,
            "connect": self.connect,
            "send_point": self.send_point,
            "recv_point": self.recv_point,
            "verify": self.verify,
            "memcpy": self.memcpy,
            "bare_target": self.bare_target,
            "bare_point": self.bare_point,
            "teardown": self.teardown,
        }

    def setup(self, a: dict) -> dict:
        self.teardown(a)
        s = a["shape"]
        shape = (a["num_blocks"], s["layers"], 2, s["block_size"], s["heads"], s["head_dim"])
        device = torch.device(a.get("device", "cpu"))
        self.cache = torch.empty(shape, dtype=_DTYPES[s["dtype"]], device=device)
        blocks = CacheLayout(self.cache).blocks
        fill = pattern_byte(np.arange(a["num_blocks"])) if a["role"] == "sender" else None
        for b in range(a["num_blocks"]):  # touch every page now, not during a timed transfer
            blocks[b].fill_(int(fill[b]) if fill is not None else 0)
        config = TransferConfig.from_env(backend=a["backend"])
        fp = Fingerprint.for_kv_cache(self.cache, "bench")
        self.agent = KVTransferAgent(config, self.cache, f"bench-{a['role']}", fp)
        self.events = Events(self.agent)
        return {"address": self.agent.address, "name": self.agent.agent_name}

    def connect(self, a: dict) -> str:
        return self._agent().connect(a["address"])

    def send_point(self, a: dict) -> dict:
        """Await the receiver's TransferRequests, then per rep time write -> TransferDone,
        back to back (as a busy prefill node would, and as the bare loop does)."""
        agent = self._agent()
        reqs = [self.events.wait_request(rid) for rid in a["rids"]]
        starts, lat = [], []
        for req, src in zip(reqs, a["src"], strict=True):
            rid = req.request_id
            t0 = time.perf_counter()
            agent.write(rid, a["peer"], src, req.dst_block_ids)
            self.events.wait_for(_ended(TransferDone, rid))
            lat.append(time.perf_counter() - t0)
            starts.append(t0)
        return {"starts": starts, "lat": lat}

    def recv_point(self, a: dict) -> list[float]:
        """Ask for every rep's write up front, note when each notification arrived."""
        agent = self._agent()
        for rid, dst in zip(a["rids"], a["dst"], strict=True):
            agent.request_transfer(a["peer"], rid, dst)
        landed = []
        for rid in a["rids"]:
            self.events.wait_for(_ended(KVReceived, rid))
            landed.append(time.perf_counter())
        return landed

    def verify(self, a: dict) -> bool:
        blocks = CacheLayout(self._cache()).blocks
        want = torch.from_numpy(pattern_byte(np.asarray(a["src"]))).to(blocks.device)
        got = blocks[torch.tensor(a["dst"], device=blocks.device)]
        return bool((got == want[:, None]).all())

    def memcpy(self, a: dict) -> list[float]:
        """Plain torch copy of the same number of bytes (the ceiling), from a different
        region of the cache each rep so that, like the transfers, it is not cache-hot."""
        cache = self._cache()
        flat = CacheLayout(cache).blocks.view(-1)
        nbytes, bb = a["nbytes"], cache[0].numel() * cache.element_size()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=cache.device)
        dst.copy_(flat[:nbytes])  # fault the destination in
        sync = torch.cuda.synchronize if cache.is_cuda else (lambda: None)
        starts = _region_starts(cache.shape[0], nbytes // bb, a["reps"])
        times = []
        for start in starts:
            src = flat[start * bb : start * bb + nbytes]
            sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            times.append(time.perf_counter() - t0)
        return times

    # -- bare NIXL: one contiguous region, one descriptor, no bookkeeping --------------------

    def bare_target(self, a: dict) -> dict:
        """Receiver side: a bare agent whose UCX worker a thread progresses every 1 ms
        (connection wire-up needs the target's progress; the writes themselves do not),
        and a zmq PULL socket whose own thread takes the bare+notify point's notifications
        as they come (as the agent's progress thread takes a KVDone)."""
        agent, addr = self._bare_agent()
        stop = threading.Event()
        pull: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        port = pull.bind_to_random_port("tcp://127.0.0.1")

        def progress() -> None:
            while not stop.wait(0.001):
                agent.get_new_notifs()

        def notifications() -> None:
            while not stop.is_set():
                if pull.poll(100):
                    pull.recv()
            pull.close()

        self.bare["stop"] = stop
        self.bare["threads"] = [
            threading.Thread(target=f, daemon=True) for f in (progress, notifications)
        ]
        for t in self.bare["threads"]:
            t.start()
        notify = f"tcp://127.0.0.1:{port}"
        return {"metadata": agent.get_agent_metadata(), "addr": addr, "notify": notify}

    def bare_point(self, a: dict) -> list[float]:
        """One descriptor of n contiguous blocks per transfer, no notification, no layer:
        descriptor lists prepared once (one entry per start block), then per rep
        make_prepped_xfer + transfer + poll + release, at a different region each rep.
        With a["with_notify"], each rep then also sends a small zmq message to the target
        (the floor of any write that tells its receiver over a socket)."""
        agent, base = self._bare_agent()
        if "peer" not in self.bare:
            self.bare["peer"] = agent.add_remote_agent(a["metadata"])
        push = self._bare_push(a["notify"]) if a["with_notify"] else None
        cache = self._cache()
        bb = cache[0].numel() * cache.element_size()
        n, num_blocks = a["nbytes"] // bb, cache.shape[0]
        mem, dev = ("VRAM", cache.device.index or 0) if cache.is_cuda else ("DRAM", 0)
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _regions(base, num_blocks, n, bb, dev), mem
        )  # (both workers run on the same device)
        remote = agent.prep_xfer_dlist(
            self.bare["peer"], _regions(a["addr"], num_blocks, n, bb, dev), mem
        )
        times = []
        try:
            for start in _region_starts(num_blocks, n, a["reps"]):
                t0 = time.perf_counter()
                handle = agent.make_prepped_xfer("WRITE", local, [start], remote, [start])
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                agent.release_xfer_handle(handle)
                if push is not None:
                    push.send(_NOTIFICATION, zmq.NOBLOCK)
                times.append(time.perf_counter() - t0)
                if state != "DONE":
                    raise RuntimeError(f"bare nixl transfer: {state}")
        finally:
            local.release()
            remote.release()
        return times

    def _bare_push(self, address: str) -> zmq.Socket[bytes]:
        """The bare sender's PUSH socket to the target's notification socket (made once)."""
        if "push" not in self.bare:
            push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 100_000)
            push.connect(address)
            self.bare["push"] = push
        return self.bare["push"]

    def _bare_agent(self) -> tuple[nixl_agent, int]:
        """The bare NIXL agent (made on first use) and the cache's base address."""
        cache = self._cache()
        if "agent" not in self.bare:
            from nixl._api import nixl_agent, nixl_agent_config

            conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            agent = nixl_agent(f"bare-{uuid.uuid4().hex[:8]}", conf)
            agent.register_memory(cache)
            self.bare["agent"] = agent
        return self.bare["agent"], cache.data_ptr()

    def teardown(self, a: dict) -> None:
        if "stop" in self.bare:
            self.bare["stop"].set()
            for t in self.bare["threads"]:
                t.join(5)
        if "push" in self.bare:
            self.bare["push"].close(linger=0)
        if self.agent is not None:
            self.agent.close()
        self.agent, self.bare = None, {}

    def _agent(self) -> KVTransferAgent:
        if self.agent is None:
            raise RuntimeError("bench worker: no agent (setup has not run)")
        return self.agent

    def _cache(self) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("bench worker: no cache (setup has not run)")
        return self.cache


def _region_starts(num_blocks: int, n: int, reps: int) -> list[int]:
    """A different start block per rep for a region of n contiguous blocks."""
    rng = np.random.default_rng(n)
    return rng.integers(0, num_blocks - n + 1, size=reps).tolist()


def _regions(
    base: int, num_blocks: int, n: int, block_bytes: int, device_id: int = 0
) -> np.ndarray:
    """[num_blocks - n + 1, 3] descriptors: n contiguous blocks starting at each block."""
    starts = np.arange(num_blocks - n + 1, dtype=np.uint64)
    rows = np.empty((starts.size, 3), dtype=np.uint64)
    rows[:, 0] = base + starts * block_bytes
    rows[:, 1] = n * block_bytes
    rows[:, 2] = device_id
    return rows


def _is_request(ev: TransferEvent, rid: str) -> bool:
    return (
        isinstance(ev, MessageReceived)
        and isinstance(ev.message, TransferRequest)
        and ev.message.request_id == rid
    )


def _ended(kind: type[TransferDone | KVReceived], rid: str) -> Callable[[TransferEvent], bool]:
    """Matches the `kind` event (TransferDone, KVReceived) of request rid."""
    return lambda e: isinstance(e, kind) and e.request_id == rid


def main(endpoint: str) -> None:
    # One intra-op thread: the memcpy ceiling is one copy stream, like one transfer, and
    # torch's thread pool wake-ups made 2 MiB copies 25x slower on a busy 2-core host.
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # peer-lost notes at teardown are expected
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send(msgpack.packb({"ready": True}))
    worker = Worker()
    while True:
        req = msgpack.unpackb(sock.recv(), raw=False)
        if req["op"] == "exit":
            worker.teardown(req)
            sock.send(msgpack.packb({"ok": True, "result": None}))
            break
        try:
            reply = {"ok": True, "result": worker.ops[req["op"]](req)}
        except Exception as e:  # reported to the driver, which stops the run
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sock.send(msgpack.packb(reply, use_bin_type=True))
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1])
