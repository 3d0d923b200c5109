"""ZeroMQ backend: the portable fallback, blocks as single-part messages over TCP or IPC.

    sender PUSH ──[u32 n][BlockWrite header: part i of k, its dst blocks][blocks]──> PULL
    receiver copies each part's blocks into their destination blocks; after the k-th,
    receiver ──KVDone (side channel)──> sender

A write goes out as k self-describing single-part messages of up to `PART_BYTES` each (one
block at least): the sender copies the header and the part's blocks into one buffer, sent
zero-copy from there. Not one multipart message with a frame per block: libzmq (4.3.5) aborts
the sending process with an errno assertion (session_base.cpp, clean_pipes) when the peer's
connection drops while a multipart message is half sent, so a decode node dying mid-transfer
would take the prefill node with it. Not one message for the whole write either: a single
huge message runs at half the speed (the receiver faults in a fresh buffer each time).
With a cluster token each header is followed by its seal (auth.py, label "data"): the PULL
socket takes connections from anyone, and only a sealed header from a peer's incarnation, not
seen before, may land bytes. A write counts as done at the sender once the receiver
acknowledged it and zmq released every part. zmq cannot take back queued messages, so
cancel() never succeeds: an aborted posted write finishes.
"""

from __future__ import annotations

import logging
import os
import struct
import uuid
from dataclasses import dataclass

import numpy as np
import zmq

from common.wire.messages import (
    BlockWrite,
    KVAborted,
    KVDone,
    Message,
    MessageError,
    PeerInfo,
    decode,
    encode,
)
from kv_transfer.auth import SEAL_BYTES, Opener, Sealer
from kv_transfer.backends.base import (
    Backend,
    BackendEvent,
    Landed,
    SendFn,
    WriteCompleted,
    WriteFailed,
)
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferRejected, TransportError
from kv_transfer.layout import CacheLayout, check_block_ids
from kv_transfer.state import OutgoingTransfer

log = logging.getLogger(__name__)


HEADER_LEN = struct.Struct("<I")
PART_BYTES = 4 * 2**20  # blocks per message: as many as fit (one at least)


@dataclass
class _Send:
    xfer: OutgoingTransfer
    trackers: list[zmq.MessageTracker]
    staging: list[np.ndarray]  # the messages' memory: alive until zmq released them
    acked: bool = False

    @property
    def released(self) -> bool:
        return all(t.done for t in self.trackers)


@dataclass
class _Arriving:
    """Parts of one incoming write received so far."""

    parts: int
    seen: set[int]
    blocks: int = 0  # landed so far


class ZmqBackend(Backend):
    name = "zmq"

    def __init__(
        self, agent_name: str, layout: CacheLayout, config: TransferConfig, send: SendFn
    ) -> None:
        super().__init__(agent_name, layout, config, send)
        # [num_blocks, block_bytes] uint8: a host cache in place; None: staged (a device cache)
        self._blocks = None if layout.staged else layout.host_blocks()
        self._ctx = zmq.Context(io_threads=1)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._ipc_path: str | None = None
        if config.zmq_transport == "ipc":
            self._ipc_path = os.path.join(config.ipc_dir, f"pdkv-{uuid.uuid4().hex[:16]}.sock")
            self.endpoint = f"ipc://{self._ipc_path}"
            self._pull.bind(self.endpoint)
        else:
            port = self._pull.bind_to_random_port(f"tcp://{config.host}")
            self.endpoint = f"tcp://{config.host}:{port}"
        self._pushes: dict[str, zmq.Socket] = {}
        self._sends: dict[str, _Send] = {}
        self._arriving: dict[tuple[str, str, int], _Arriving] = {}  # (src, request, xfer)
        self._refused: set[tuple[str, str, int]] = set()  # writes whose later parts we drop
        self._seq = 0
        token = config.cluster_token
        self._sealer = None if token is None else Sealer(token.encode(), b"data", agent_name)
        self._opener = None if token is None else Opener(token.encode(), b"data", agent_name)

    def metadata(self) -> bytes:
        return self.endpoint.encode()

    def add_peer(self, info: PeerInfo, send_channel: int, recv_channel: int) -> None:
        endpoint = info.backend_metadata.decode(errors="replace")
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise TransportError(f"zmq: peer {info.agent_name} sent a bad endpoint {endpoint!r}")
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(endpoint)
        self._pushes[info.agent_name] = push

    def remove_peer(self, peer_id: str) -> list[BackendEvent]:
        push = self._pushes.pop(peer_id, None)
        if push is not None:
            push.close(linger=0)  # drops whatever is still queued
        lost = [s for s in self._sends.values() if s.xfer.peer_id == peer_id]
        for s in lost:
            del self._sends[s.xfer.request_id]
        for key in [k for k in self._arriving if k[0] == peer_id]:
            del self._arriving[key]  # half-arrived writes: the layer ends them (peer lost)
        self._refused = {k for k in self._refused if k[0] != peer_id}
        return [WriteFailed(s.xfer.request_id, "peer lost", peer_lost=True) for s in lost]

    def post(self, xfer: OutgoingTransfer) -> BackendEvent | None:
        push = self._pushes.get(xfer.peer_id)
        if push is None:
            raise TransportError(f"zmq: peer {xfer.peer_id} is not connected")
        self._seq += 1
        per_part = max(1, PART_BYTES // self.layout.block_bytes)
        starts = range(0, len(xfer.src_ids), per_part)
        trackers, staging = [], []
        for part, start in enumerate(starts):
            header = BlockWrite(
                request_id=xfer.request_id,
                src_agent=self.agent_name,
                xfer_id=self._seq,
                dst_block_ids=xfer.dst_ids[start : start + per_part].tolist(),
                part=part,
                parts=len(starts),
            )
            head = encode(header)
            seal = b"" if self._sealer is None else self._sealer.seal(xfer.peer_id, head)
            buf = self._pack(head + seal, xfer.src_ids[start : start + per_part])
            try:
                # .data (a memoryview): numpy types ndarray as a Buffer only from Python 3.12 on
                trackers.append(push.send(buf.data, zmq.NOBLOCK, copy=False, track=True))
            except zmq.ZMQError as e:  # (an unlimited HWM: only a closing socket refuses)
                raise TransportError(f"zmq: cannot send {xfer.request_id}: {e}") from e
            staging.append(buf)
        self._sends[xfer.request_id] = _Send(xfer, trackers, staging)
        return None

    def _pack(self, head: bytes, src_ids: np.ndarray) -> np.ndarray:
        """[header length][header (and its seal)][blocks...] in one buffer."""
        start = HEADER_LEN.size + len(head)
        n, block_bytes = len(src_ids), self.layout.block_bytes
        staging = np.empty(start + n * block_bytes, dtype=np.uint8)
        HEADER_LEN.pack_into(staging.data, 0, len(head))
        staging[HEADER_LEN.size : start] = np.frombuffer(head, dtype=np.uint8)
        rows = staging[start:].reshape(n, block_bytes)
        if self._blocks is None:
            self.layout.gather(src_ids, out=rows)  # device -> host, straight into the message
            return staging
        for row, block in zip(rows, src_ids, strict=True):  # 8x faster than np.take(out=)
            row[:] = self._blocks[block]
        return staging

    def cancel(self, xfer: OutgoingTransfer) -> bool:
        return False

    def progress(self) -> list[BackendEvent]:
        done = [s for s in self._sends.values() if s.acked and s.released]
        for s in done:
            del self._sends[s.xfer.request_id]
        return [WriteCompleted(s.xfer.request_id) for s in done]

    def busy(self) -> bool:
        return any(s.acked and not s.released for s in self._sends.values())

    def register(self, poller: zmq.Poller) -> None:
        poller.register(self._pull, zmq.POLLIN)

    def on_ready(self, ready: dict) -> list[BackendEvent]:
        if self._pull not in ready:
            return []
        events: list[BackendEvent] = []
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return events
            landed = self._land(frame)
            if landed is not None:
                events.append(landed)

    def on_message(self, peer_id: str, msg: Message) -> list[BackendEvent] | None:
        if not isinstance(msg, (KVDone, KVAborted)):
            return None
        send = self._sends.get(msg.request_id)
        if send is None or send.xfer.peer_id != peer_id:
            return None if isinstance(msg, KVAborted) else []
        if isinstance(msg, KVAborted):  # the receiver refused the write
            del self._sends[msg.request_id]
            return [WriteFailed(msg.request_id, f"receiver refused: {msg.reason}")]
        send.acked = True
        return self.progress()

    def close(self) -> None:
        for push in self._pushes.values():
            push.close(linger=0)
        self._pushes.clear()
        self._pull.close(linger=0)
        self._ctx.term()
        if self._ipc_path is not None and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)

    # -- receiving ---------------------------------------------------------------------------

    def _land(self, frame: zmq.Frame) -> Landed | None:
        """Copy one part into place; the Landed event once a write's last part is in."""
        data = memoryview(frame.buffer)
        try:
            head, payload = self._split(data)
            seal = None
            if self._opener is not None:
                head, seal = head[:-SEAL_BYTES], head[-SEAL_BYTES:]
            header = decode(head, self.config.max_message_bytes)
        except MessageError as e:
            log.warning("zmq: dropped a data message with a bad header: %s", e)
            return None
        if not isinstance(header, BlockWrite) or header.src_agent not in self._pushes:
            log.warning("zmq: dropped a data message (%s) from a non-peer", header.TYPE)
            return None
        if self._opener is not None and not self._opener.open(header.src_agent, head, seal):
            log.warning("zmq: dropped a data message not sealed by %s", header.src_agent)
            return None
        key = (header.src_agent, header.request_id, header.xfer_id)
        if key in self._refused:
            return None
        try:
            dst = self._check(header, payload)
            if not self.accepts(header.src_agent, header.request_id, dst):
                raise TransferRejected("no transfer of this request into these blocks is expected")
            arriving = self._arriving.setdefault(key, _Arriving(header.parts, set()))
            if header.parts != arriving.parts or header.part in arriving.seen:
                raise TransferRejected(f"part {header.part} of {header.parts} does not fit")
        except TransferRejected as e:
            log.warning("zmq: refused write %s from %s: %s", header.request_id, header.src_agent, e)
            self._arriving.pop(key, None)
            self._refused.add(key)
            self.send(header.src_agent, KVAborted(request_id=header.request_id, reason=str(e)))
            return None
        rows = payload.reshape(dst.size, self.layout.block_bytes)
        if self._blocks is None:
            self.layout.scatter(dst, rows)
        else:
            self._blocks[dst] = rows
        arriving.seen.add(header.part)
        arriving.blocks += dst.size
        if len(arriving.seen) < arriving.parts:
            return None
        del self._arriving[key]
        self.send(header.src_agent, KVDone(request_id=header.request_id))
        return Landed(header.src_agent, header.request_id, arriving.blocks)

    def _split(self, data: memoryview) -> tuple[bytes, np.ndarray]:
        """The header bytes and the block payload of one data message."""
        if len(data) < HEADER_LEN.size:
            raise MessageError(f"a {len(data)}-byte data message has no header")
        (head_len,) = HEADER_LEN.unpack_from(data, 0)
        start = HEADER_LEN.size + head_len
        if head_len > self.config.max_message_bytes or start > len(data):
            raise MessageError(f"a header of {head_len} bytes in a {len(data)}-byte message")
        payload = np.frombuffer(data, dtype=np.uint8, offset=start)
        return bytes(data[HEADER_LEN.size : start]), payload

    def _check(self, header: BlockWrite, payload: np.ndarray) -> np.ndarray:
        if header.part >= header.parts:
            raise TransferRejected(f"part {header.part} of {header.parts}")
        dst = check_block_ids(header.dst_block_ids, self.layout.num_blocks, "dst_block_ids")
        if payload.size != dst.size * self.layout.block_bytes:
            raise TransferRejected(
                f"{payload.size} payload bytes for {dst.size} blocks of {self.layout.block_bytes}"
            )
        return dst
