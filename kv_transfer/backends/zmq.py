"""ZeroMQ backend: the portable fallback, one message per write over TCP or IPC.

    sender PUSH ──[u32 header length][BlockWrite header][block][block]...──> receiver PULL
    receiver copies the blocks into their destination blocks, then
    receiver ──KVDone (side channel)──> sender

Each write is ONE single-part message: the sender gathers the blocks into a staging buffer
behind the header (one copy, sent zero-copy from there). Not a multipart message with a
frame per block: libzmq (4.3.5) aborts the sending process with an errno assertion
(session_base.cpp, clean_pipes) when the peer's connection drops while a multipart message
is half sent, so a decode node dying mid-transfer would take the prefill node with it.
A write counts as done at the sender once the receiver acknowledged it and zmq released the
staging buffer. zmq cannot take back queued messages, so cancel() never succeeds: an aborted
posted write finishes.
"""

from __future__ import annotations

import logging
import os
import struct
import uuid
from dataclasses import dataclass

import numpy as np
import zmq

from common.messages import (
    BlockWrite,
    KVAborted,
    KVDone,
    Message,
    MessageError,
    PeerInfo,
    decode,
    encode,
)
from kv_transfer.backends.base import (
    Backend,
    BackendEvent,
    Landed,
    SendFn,
    WriteCompleted,
    WriteFailed,
)
from kv_transfer.config import TransferConfig
from kv_transfer.errors import BackendError, TransferRejected
from kv_transfer.layout import CacheLayout, check_block_ids
from kv_transfer.state import OutgoingTransfer

log = logging.getLogger(__name__)


HEADER_LEN = struct.Struct("<I")


@dataclass
class _Send:
    xfer: OutgoingTransfer
    tracker: zmq.MessageTracker
    staging: np.ndarray  # the message's memory: alive until zmq released it
    acked: bool = False


class ZmqBackend(Backend):
    name = "zmq"

    def __init__(
        self, agent_name: str, layout: CacheLayout, config: TransferConfig, send: SendFn
    ) -> None:
        super().__init__(agent_name, layout, config, send)
        self._blocks = layout.blocks.numpy()  # [num_blocks, block_bytes] uint8, shared memory
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
        self._seq = 0

    def metadata(self) -> bytes:
        return self.endpoint.encode()

    def add_peer(self, info: PeerInfo, send_channel: int, recv_channel: int) -> None:
        endpoint = info.backend_metadata.decode(errors="replace")
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise BackendError(f"zmq: peer {info.agent_name} sent a bad endpoint {endpoint!r}")
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
        return [WriteFailed(s.xfer.request_id, "peer lost", peer_lost=True) for s in lost]

    def post(self, xfer: OutgoingTransfer) -> BackendEvent | None:
        push = self._pushes.get(xfer.peer_id)
        if push is None:
            raise BackendError(f"zmq: peer {xfer.peer_id} is not connected")
        self._seq += 1
        header = BlockWrite(
            request_id=xfer.request_id,
            src_agent=self.agent_name,
            xfer_id=self._seq,
            dst_block_ids=xfer.dst_ids.tolist(),
        )
        staging = self._pack(encode(header), xfer.src_ids)
        try:
            tracker = push.send(staging, zmq.NOBLOCK, copy=False, track=True)
        except zmq.ZMQError as e:
            raise BackendError(f"zmq: cannot send {xfer.request_id}: {e}") from e
        self._sends[xfer.request_id] = _Send(xfer, tracker, staging)
        return None

    def _pack(self, head: bytes, src_ids: np.ndarray) -> np.ndarray:
        """[header length][header][blocks...] in one buffer (the blocks gathered in one copy)."""
        start = HEADER_LEN.size + len(head)
        n, block_bytes = len(src_ids), self.layout.block_bytes
        staging = np.empty(start + n * block_bytes, dtype=np.uint8)
        HEADER_LEN.pack_into(staging, 0, len(head))
        staging[HEADER_LEN.size : start] = np.frombuffer(head, dtype=np.uint8)
        np.take(self._blocks, src_ids, axis=0, out=staging[start:].reshape(n, block_bytes))
        return staging

    def cancel(self, xfer: OutgoingTransfer) -> bool:
        return False

    def progress(self) -> list[BackendEvent]:
        done = [s for s in self._sends.values() if s.acked and s.tracker.done]
        for s in done:
            del self._sends[s.xfer.request_id]
        return [WriteCompleted(s.xfer.request_id) for s in done]

    def busy(self) -> bool:
        return any(s.acked and not s.tracker.done for s in self._sends.values())

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
        data = memoryview(frame.buffer)
        try:
            head, payload = self._split(data)
            header = decode(head, self.config.max_message_bytes)
        except MessageError as e:
            log.warning("zmq: dropped a data message with a bad header: %s", e)
            return None
        if not isinstance(header, BlockWrite) or header.src_agent not in self._pushes:
            log.warning("zmq: dropped a data message (%s) from a non-peer", header.TYPE)
            return None
        try:
            dst = self._check(header, payload)
        except TransferRejected as e:
            log.warning("zmq: refused write %s from %s: %s", header.request_id, header.src_agent, e)
            self.send(header.src_agent, KVAborted(request_id=header.request_id, reason=str(e)))
            return None
        self._blocks[dst] = payload.reshape(dst.size, self.layout.block_bytes)
        self.send(header.src_agent, KVDone(request_id=header.request_id))
        return Landed(header.src_agent, header.request_id)

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
        dst = check_block_ids(header.dst_block_ids, self.layout.num_blocks, "dst_block_ids")
        if payload.size != dst.size * self.layout.block_bytes:
            raise TransferRejected(
                f"{payload.size} payload bytes for {dst.size} blocks of {self.layout.block_bytes}"
            )
        return dst
