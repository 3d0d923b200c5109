"""ucxx backend: UCX tag messages, one per block, straight from and into the cache.

    sender ──BlockWrite{xfer_id, dst_block_ids} (side channel)──> receiver
    sender ──tag_send(block src[i], tag(channel, xfer_id, i))──> receiver's tag_recv into dst[i]
    receiver (all receives complete) ──KVDone (side channel)──> sender

Endpoints are created from worker addresses exchanged in the handshake.
UCX error handling is on by default (config.ucxx_error_handling): without it
UCX uses cma/shared memory here (about 5x faster), but a sender that dies in
the middle of a rendezvous makes UCX abort the *receiving* process (measured:
"process_vm_readv ... No such process", then SIGABRT), and a dead peer's
requests are never settled. With it, this UCX (1.21) sends over TCP. Peer loss
is detected by the side channel either way. Progress is polled by the agent's
progress thread. Per-block messages need neither a staging copy nor a pickle,
and measured as fast as one large contiguous message.

Tags are matched per worker, not per endpoint, so each is made unique at the
receiver: the receiver assigns each peer a channel id in the handshake.

    tag = channel (20 bits) | xfer_id mod 2**24 (24 bits) | block index (20 bits)

UCX tag sends cannot be taken back one by one, so cancel() never succeeds: an
aborted posted write finishes. Closing a lost peer's endpoint cancels its
requests; remove_peer() waits (bounded) until they are settled.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from common.wire.messages import BlockWrite, KVAborted, KVDone, Message, PeerInfo
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

if TYPE_CHECKING:  # ucxx ships no type information: to mypy this name is Any
    from ucxx._lib.libucxx import UCXEndpoint

log = logging.getLogger(__name__)

_MAX_BLOCKS = 2**20
_SEQ_MASK = 2**24 - 1


def _peer_errors(api: ModuleType) -> tuple[type[BaseException], ...]:
    names = (
        "UCXConnectionResetError",
        "UCXEndpointTimeoutError",
        "UCXUnreachableError",
        "UCXNotConnectedError",
        "UCXCanceledError",
        "UCXIOError",
    )
    return tuple(getattr(api, n) for n in names if hasattr(api, n))


def _tag_base(channel: int, xfer_id: int) -> int:
    return (channel << 44) | ((xfer_id & _SEQ_MASK) << 20)


@dataclass
class _UcxxPeer:
    ep: UCXEndpoint
    send_channel: int
    recv_channel: int
    seq: int = 0


@dataclass
class _Requests:
    """UCX requests of one write (either side); completes roughly in order."""

    peer_id: str
    request_id: str
    reqs: list
    upto: int = 0
    acked: bool = False  # sender side: the receiver's KVDone arrived
    # A staged (device) cache: the host rows the tag messages read or fill, and (receiver)
    # the blocks they are copied into once every message has landed.
    staging: np.ndarray | None = None
    dst: np.ndarray | None = None

    def complete(self) -> bool:
        while self.upto < len(self.reqs) and self.reqs[self.upto].completed:
            self.upto += 1
        return self.upto == len(self.reqs)

    def error(self, api: ModuleType) -> tuple[str, bool] | None:
        """(detail, says the peer is gone) of the first failed request, or None."""
        for r in self.reqs:
            try:
                r.check_error()
            except api.UCXError as e:
                gone = isinstance(e, _peer_errors(api))
                return f"{type(e).__name__}: {e}", gone
        return None


class UcxxBackend(Backend):
    name = "ucxx"

    def __init__(
        self, agent_name: str, layout: CacheLayout, config: TransferConfig, send: SendFn
    ) -> None:
        super().__init__(agent_name, layout, config, send)
        # ucxx sets UCX_MEMTYPE_CACHE, which this UCX build warns is unused on every start.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array

        self._api, self._arr, self._tag = ucx_api, Array, ucx_api.UCXXTag
        # [num_blocks, block_bytes] uint8: a host cache in place; None: staged (a device cache)
        self._blocks = None if layout.staged else layout.host_blocks()
        self._ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,))
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._address = ucx_api.UCXAddress.create_from_worker(self._worker)
        self._peers: dict[str, _UcxxPeer] = {}
        self._sends: dict[str, _Requests] = {}
        self._recvs: dict[str, _Requests] = {}

    def metadata(self) -> bytes:
        return self._address.tobytes()

    def add_peer(self, info: PeerInfo, send_channel: int, recv_channel: int) -> None:
        api = self._api
        try:
            address = api.UCXAddress.create_from_buffer(info.backend_metadata)
            ep = api.UCXEndpoint.create_from_worker_address(
                self._worker, address, self.config.ucxx_error_handling
            )
        except api.UCXError as e:
            raise TransportError(f"ucxx: cannot reach {info.agent_name}: {e}") from e
        self._peers[info.agent_name] = _UcxxPeer(ep, send_channel, recv_channel)

    def remove_peer(self, peer_id: str) -> list[BackendEvent]:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return []
        peer.ep.close_blocking()  # cancels the endpoint's in-flight sends and receives
        mine = [r for r in (*self._sends.values(), *self._recvs.values()) if r.peer_id == peer_id]
        deadline = time.monotonic() + self.config.close_timeout_s
        while not all(r.complete() for r in mine) and time.monotonic() < deadline:
            self._worker.progress()
        for r in mine:
            if not r.complete():
                log.error("ucxx: %s requests of %s not settled", r.request_id, peer_id)
        events: list[BackendEvent] = []
        for r in [r for r in self._sends.values() if r.peer_id == peer_id]:
            del self._sends[r.request_id]
            events.append(WriteFailed(r.request_id, "peer lost", peer_lost=True))
        for r in [r for r in self._recvs.values() if r.peer_id == peer_id]:
            del self._recvs[r.request_id]
        return events

    def post(self, xfer: OutgoingTransfer) -> BackendEvent | None:
        peer = self._peers.get(xfer.peer_id)
        if peer is None:
            raise TransportError(f"ucxx: peer {xfer.peer_id} is not connected")
        if xfer.src_ids.size > _MAX_BLOCKS:
            raise TransportError(f"ucxx: at most {_MAX_BLOCKS} blocks per write")
        peer.seq += 1
        header = BlockWrite(
            request_id=xfer.request_id,
            src_agent=self.agent_name,
            xfer_id=peer.seq,
            dst_block_ids=xfer.dst_ids.tolist(),
        )
        if not self.send(xfer.peer_id, header):
            raise TransportError(f"ucxx: cannot announce {xfer.request_id} to {xfer.peer_id}")
        # A staged cache: the blocks copied to host rows first, sent from there.
        staging = None if self._blocks is not None else self.layout.gather(xfer.src_ids)
        reqs = self._per_block(peer.ep.tag_send, peer.send_channel, peer.seq, xfer.src_ids, staging)
        self._sends[xfer.request_id] = _Requests(
            xfer.peer_id, xfer.request_id, reqs, staging=staging
        )
        return None

    def cancel(self, xfer: OutgoingTransfer) -> bool:
        return False

    def progress(self) -> list[BackendEvent]:
        self._worker.progress()
        events: list[BackendEvent] = []
        for r in [r for r in self._recvs.values() if r.complete()]:
            del self._recvs[r.request_id]
            err = r.error(self._api)
            if err is not None:
                log.warning(
                    "ucxx: receive of %s from %s failed: %s", r.request_id, r.peer_id, err[0]
                )
                continue
            if r.staging is not None and r.dst is not None:
                self.layout.scatter(r.dst, r.staging)  # host rows -> the device blocks
            self.send(r.peer_id, KVDone(request_id=r.request_id))
            events.append(Landed(r.peer_id, r.request_id, len(r.reqs)))
        for r in [r for r in self._sends.values() if r.complete()]:
            err = r.error(self._api)
            if err is None and not r.acked:
                continue
            del self._sends[r.request_id]
            if err is None:
                events.append(WriteCompleted(r.request_id))
            else:
                events.append(WriteFailed(r.request_id, err[0], peer_lost=err[1]))
        return events

    def busy(self) -> bool:
        """UCX requests need progress; a send only waiting for its ack does not (the
        ack arrives on the side channel, which wakes the progress thread)."""
        return bool(self._recvs) or any(not r.complete() for r in self._sends.values())

    def on_message(self, peer_id: str, msg: Message) -> list[BackendEvent] | None:
        if isinstance(msg, BlockWrite):
            self._on_block_write(peer_id, msg)
            return []
        if not isinstance(msg, (KVDone, KVAborted)):
            return None
        send = self._sends.get(msg.request_id)
        if send is None or send.peer_id != peer_id:
            return None if isinstance(msg, KVAborted) else []
        if isinstance(msg, KVAborted):  # the receiver refused the write
            del self._sends[msg.request_id]
            return [WriteFailed(msg.request_id, f"receiver refused: {msg.reason}")]
        send.acked = True
        return self.progress()

    def close(self) -> None:
        for peer_id in list(self._peers):
            self.remove_peer(peer_id)
        self._sends.clear()
        self._recvs.clear()
        # Destroy the UCX objects here, in order, not whenever the GC gets to them.
        self._address = self._worker = self._ctx = None

    def _on_block_write(self, peer_id: str, msg: BlockWrite) -> None:
        peer = self._peers.get(peer_id)
        if peer is None or msg.src_agent != peer_id:
            log.warning("ucxx: dropped a BlockWrite from %s claiming %s", peer_id, msg.src_agent)
            return
        try:
            dst = check_block_ids(msg.dst_block_ids, self.layout.num_blocks, "dst_block_ids")
            if msg.request_id in self._recvs:
                raise TransferRejected(f"{msg.request_id} is already being received")
            if not self.accepts(peer_id, msg.request_id, dst):
                raise TransferRejected("no transfer of this request into these blocks is expected")
        except TransferRejected as e:
            self.send(peer_id, KVAborted(request_id=msg.request_id, reason=str(e)))
            return
        # A staged cache: received into host rows, copied into the blocks once all landed.
        staging = None if self._blocks is not None else self.layout.staging(dst.size)
        reqs = self._per_block(peer.ep.tag_recv, peer.recv_channel, msg.xfer_id, dst, staging)
        self._recvs[msg.request_id] = _Requests(
            peer_id, msg.request_id, reqs, staging=staging, dst=dst
        )

    def _per_block(
        self,
        op: Callable,
        channel: int,
        xfer_id: int,
        block_ids: np.ndarray,
        staging: np.ndarray | None = None,
    ) -> list:
        """One tag message per block: op(block i's memory, its tag), in order; with
        `staging`, row i of it stands for block i."""
        base, arr, tag = _tag_base(channel, xfer_id), self._arr, self._tag
        if staging is not None:
            return [op(arr(staging[i]), tag(base | i)) for i in range(len(block_ids))]
        blocks = self._blocks
        assert blocks is not None
        return [op(arr(blocks[b]), tag(base | i)) for i, b in enumerate(block_ids)]
