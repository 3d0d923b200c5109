"""A test node: one process hosting a KVTransferAgent, driven by the test over zmq.

    python -m tests.support.kv_agent_node <control endpoint>

The test binds a PAIR socket; this process connects, says {"ready": pid}, then
answers msgpack requests {"op": name, ...} with {"ok": true, "result": ...} or
{"ok": false, "error": "..."}. Operations are dispatched through a dict. The
cache may live in a shared-memory file so the test can inspect it after this
process was SIGKILLed.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import sys
import traceback
from collections.abc import Callable

import msgpack
import numpy as np
import torch
import zmq

from common.wire.fingerprint import Fingerprint
from common.wire.messages import Message
from kv_transfer import KVTransferAgent, TransferConfig

log = logging.getLogger("kv_agent_node")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _cache(spec: dict) -> torch.Tensor:
    shape = (spec["num_blocks"], spec["layers"], 2, spec["block_size"], spec["heads"], spec["dim"])
    dtype = _DTYPES[spec["dtype"]]
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if spec.get("shm_path"):
        raw = np.memmap(spec["shm_path"], dtype=np.uint8, mode="w+", shape=(nbytes,))
        return torch.from_numpy(raw).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype)


def pattern(seed: int, block_id: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for one block, distinct per (seed, block): uint8 [nbytes]."""
    x = np.arange(nbytes, dtype=np.uint64) * np.uint64(2654435761)
    x += np.uint64(block_id * 40503 + seed * 977 + 1)
    return ((x >> np.uint64(11)) & np.uint64(0xFF)).astype(np.uint8)


def _event(ev: object) -> dict:
    out: dict = {"kind": type(ev).__name__}
    for f in dataclasses.fields(ev):  # type: ignore[arg-type]
        value = getattr(ev, f.name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, Message):
            out["message_type"] = value.TYPE
            value = value.model_dump(mode="python")
        out[f.name] = value
    return out


class Node:
    def __init__(self) -> None:
        self.agent: KVTransferAgent | None = None
        self.cache: torch.Tensor | None = None
        self.ops: dict[str, Callable[[dict], object]] = {
            "start": self.start,
            "connect": lambda a: self.agent.connect(a["address"]),
            "write": lambda a: self.agent.write(
                a["rid"], a["peer"], a["src"], a["dst"], a.get("final", True)
            ),
            "write_more": lambda a: self.agent.write_more(
                a["rid"], a["peer"], a["src"], a["dst"], a["final"]
            ),
            "request": lambda a: self.agent.request_transfer(a["peer"], a["rid"], a["dst"]),
            "abort": lambda a: self.agent.abort(a["rid"]),
            "write_then_abort": self.write_then_abort,
            "events": self.events,
            "fill": self.fill,
            "fill_pattern": self.fill_pattern,
            "read": self.read,
            "stop_agent": self.stop_agent,
            "rejected": lambda a: self.agent.rejected_messages,
            "quarantined": lambda a: self.agent.quarantined,
            "quarantine_timeouts": lambda a: self.agent.quarantine_timeouts,
        }

    def start(self, a: dict) -> dict:
        self.stop_agent(a)
        self.cache = _cache(a["cache"])
        fp = Fingerprint.for_kv_cache(self.cache, a.get("weights_hash", "w0"))
        config = TransferConfig(backend=a["backend"], **a.get("config", {}))
        self.agent = KVTransferAgent(config, self.cache, a["engine_id"], fp)
        return {"address": self.agent.address, "name": self.agent.agent_name}

    def stop_agent(self, a: dict) -> list[dict]:
        if self.agent is None:
            return []
        self.agent.close()
        events = [_event(e) for e in self.agent.poll_events()]
        self.agent = None
        return events

    def events(self, a: dict) -> list[dict]:
        """Drain events, first waiting up to `wait` seconds for one if none is pending."""
        if a.get("wait"):
            return [_event(e) for e in self.agent.wait_events(a["wait"])]
        return [_event(e) for e in self.agent.poll_events()]

    def write_then_abort(self, a: dict) -> list[bool]:
        """Issue every write, then at once abort some (no RPC round trips in between)."""
        for w in a["writes"]:
            self.agent.write(w["rid"], a["peer"], w["src"], w["dst"])
        return [self.agent.abort(rid) for rid in a["abort"]]

    def fill(self, a: dict) -> None:
        blocks = self.agent.layout.blocks
        data = np.frombuffer(a["data"], dtype=np.uint8).reshape(len(a["ids"]), -1)
        blocks[torch.tensor(a["ids"])] = torch.from_numpy(data.copy())

    def fill_pattern(self, a: dict) -> None:
        blocks = self.agent.layout.blocks.numpy()
        for b in a["ids"]:
            blocks[b] = pattern(a["seed"], b, blocks.shape[1])

    def read(self, a: dict) -> bytes:
        return self.agent.layout.blocks[torch.tensor(a["ids"])].numpy().tobytes()


def main(endpoint: str) -> None:
    # Started by tests.support.kv_agents through procs: it dies with the test process.
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send(msgpack.packb({"ready": os.getpid()}))
    node = Node()
    while True:
        req = msgpack.unpackb(sock.recv(), raw=False)
        if req["op"] == "exit":
            node.stop_agent({})
            sock.send(msgpack.packb({"ok": True, "result": None}))
            break
        try:
            reply = {"ok": True, "result": node.ops[req["op"]](req)}
        except Exception as e:  # reported to the test, which decides
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        sock.send(msgpack.packb(reply, use_bin_type=True))
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1])
