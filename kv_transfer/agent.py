"""KVTransferAgent: one per node; moves KV blocks to and from peers and reports events.

Threading model
---------------
The agent owns one daemon *progress thread*. It alone touches the sockets, and
it drives the backend (NIXL agent / UCX worker / zmq data sockets) and the
transfer records; it never needs the engine thread or the asyncio loop to make
progress. Public methods may be called from any thread: they validate their
arguments against a locked registry, queue a command and wake the progress
thread (an eventfd), so none of them waits on the network except connect().

One exception, for latency: a small write (<= inline_write_max_bytes) on a
backend that posts synchronously (nixl) is posted by write() itself when the
progress thread is idle, under the same state lock the progress thread holds
for each step; it only tries that lock (if the progress thread holds it, the
write is queued), so the caller is held for about the copy itself (~0.3-0.7 ms
for a 2 MiB block here) plus the receiver's KVDone, sent on the peer's outbox.

Events flow back through a queue whose fd (fileno()) is readable while events
may be pending (signalled once the state lock is free, so that a woken owner's
next write can be posted inline): poll it with poll_events(), block with
wait_events(), or await next_events() in asyncio.

Blocks are never freed here. Each transfer ends with exactly one terminal event
(events.py); the owner frees through its allocator when it sees it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch
import zmq

from common.wire.fingerprint import Fingerprint
from common.wire.messages import Message, PeerInfo, TransferRequest
from kv_transfer.auth import Sealer
from kv_transfer.backends import create_backend
from kv_transfer.config import TransferConfig
from kv_transfer.connections import Connections
from kv_transfer.errors import AgentClosed, HandshakeError, TransferRejected
from kv_transfer.events import TransferEvent
from kv_transfer.layout import CacheLayout, check_block_ids
from kv_transfer.progress import (
    AbortCmd,
    Command,
    ConnectCmd,
    ExpectCmd,
    MoreCmd,
    ProgressLoop,
    SendCmd,
    WriteCmd,
)
from kv_transfer.shared import EventQueue, Registry
from kv_transfer.side_channel import Outbox, SideChannel
from kv_transfer.state import IncomingTransfer, OutgoingTransfer
from kv_transfer.transfers import TransferBook

log = logging.getLogger(__name__)


class KVTransferAgent:
    def __init__(
        self,
        config: TransferConfig,
        kv_cache: torch.Tensor,
        engine_id: str,
        fingerprint: Fingerprint,
    ) -> None:
        self.config = config
        self.layout = CacheLayout(kv_cache, staged=config.stage_host_cache)
        _check_fingerprint(fingerprint, kv_cache)
        self.engine_id = engine_id
        self.incarnation = uuid.uuid4().hex[:12]  # new at every start
        self.agent_name = f"{engine_id}-{self.incarnation}"  # unique per process instance
        self._events = EventQueue()
        self._registry = Registry()
        self._closed = False
        self._error: BaseException | None = None
        self._ctx = zmq.Context(io_threads=1)
        poller = zmq.Poller()
        token = config.cluster_token
        sealer = None if token is None else Sealer(token.encode(), b"side", self.agent_name)
        side = SideChannel(
            self._ctx, self.agent_name, config.host, config.side_channel_port, poller, sealer
        )
        try:
            self._loop = self._build(side, poller, fingerprint)
        except BaseException:
            side.shutdown()
            self._ctx.term()
            raise
        self.address = side.address
        self._thread = threading.Thread(
            target=self._run, name=f"kv-progress-{engine_id}", daemon=True
        )
        self._thread.start()

    def _build(
        self, side: SideChannel, poller: zmq.Poller, fingerprint: Fingerprint
    ) -> ProgressLoop:
        outbox = Outbox(side)  # the book's and backend's sends, flushed by the progress thread
        backend = create_backend(self.agent_name, self.layout, self.config, outbox.send)
        backend.register(poller)
        book = TransferBook(
            backend,
            outbox.send,
            self._events.put,
            self._registry,
            self.config.max_inflight_per_peer,
            self.config.quarantine_timeout_s,
        )
        if not self.config.accept_unsolicited_writes:
            backend.accepts = book.accepts
        me = PeerInfo(
            agent_name=self.agent_name,
            engine_id=self.engine_id,
            side_channel=side.address,
            backend=self.config.backend,
            backend_metadata=backend.metadata(),
            region=self.layout.region,
            fingerprint=fingerprint,
            incarnation=self.incarnation,
        )
        conns = Connections(me, side, backend, book, self._registry, self._events.put, self.config)
        return ProgressLoop(
            poller, side, outbox, conns, book, self._events.put, self._events.publish
        )

    # -- peers -------------------------------------------------------------------------------

    def connect(self, address: str, timeout: float | None = None) -> str:
        """Handshake with the agent whose side channel is `address`; return its peer id.

        Blocks up to handshake_timeout_s (or `timeout`). Raises HandshakeError when
        refused (the message names the differing fingerprint field) or timed out.
        Connecting to an already connected address returns the same peer id.
        """
        future = self.connect_async(address)
        limit = self.config.handshake_timeout_s + 1.0 if timeout is None else timeout
        try:
            return future.result(timeout=limit)
        except TimeoutError:
            raise HandshakeError(f"handshake with {address} timed out after {limit:.1f}s") from None

    def connect_async(self, address: str) -> Future[str]:
        """Like connect(), without blocking; asyncio can await asyncio.wrap_future(f)."""
        self._check_open()
        future: Future[str] = Future()
        self._loop.submit(ConnectCmd(address, future))
        return future

    def peers(self) -> list[str]:
        return list(self._registry.peers)

    # -- transfers ---------------------------------------------------------------------------

    def write(
        self,
        request_id: str,
        peer_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        final: bool = True,
    ) -> None:
        """Start writing local blocks src_block_ids[i] into the peer's dst_block_ids[i].

        Asynchronous: the peer gets KVReceived(request_id) once every byte landed,
        and this side one terminal event (TransferDone, TransferFailed, or Quiescent
        after abort()). Raises TransferRejected for bad ids, an unknown peer, a
        request id already in flight, or one that was aborted.

        `final=False` opens a streamed write: these blocks are its first segment, and
        `write_more` gives the next ones, the last with `final=True`. The peer hears
        KVProgress per segment landed (while its expected blocks are not all in).
        """
        self._check_open()
        src, dst = self._pairs(peer_id, src_block_ids, dst_block_ids)
        self._claim(request_id, peer_id)
        nbytes = src.size * self.layout.block_bytes
        xfer = OutgoingTransfer(request_id, peer_id, src, dst, nbytes, final=final)
        if nbytes <= self.config.inline_write_max_bytes and self._loop.try_inline(xfer):
            return  # posted (and, for a small nixl write, finished) in this call
        self._submit(WriteCmd(xfer))

    def write_more(
        self,
        request_id: str,
        peer_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        final: bool,
    ) -> None:
        """The next segment of the streamed write of request_id (opened by
        `write(final=False)`), posted once the segments before it landed. Raises
        TransferRejected for bad ids or when the write has ended (its terminal event is
        then on its way); a segment given while an abort is being handled is dropped."""
        self._check_open()
        if request_id not in self._registry.active:
            raise TransferRejected(f"request {request_id!r} has no open write")
        src, dst = self._pairs(peer_id, src_block_ids, dst_block_ids)
        self._submit(MoreCmd(request_id, src, dst, final))

    def _pairs(
        self, peer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """A write's checked (source, destination) block ids; TransferRejected for bad
        ids, an unknown peer or counts that differ."""
        src = check_block_ids(src_block_ids, self.layout.num_blocks, "src_block_ids")
        region = self._registry.peers.get(peer_id)
        if region is None:
            raise TransferRejected(f"unknown peer {peer_id!r}")
        dst = check_block_ids(dst_block_ids, region.num_blocks, "dst_block_ids")
        if src.size != dst.size:
            raise TransferRejected(f"{src.size} source blocks but {dst.size} destinations")
        return src, dst

    def request_transfer(
        self,
        peer_id: str,
        request_id: str,
        dst_block_ids: Sequence[int],
        transfer_key: str = "",
        skip_blocks: int = 0,
    ) -> None:
        """Ask the peer to write request_id's KV into our (reserved) dst_block_ids;
        `transfer_key` is the capability the sender gave out for that KV (if it uses one),
        `skip_blocks` how many of its leading blocks we have already (not to be sent).

        Sends a TransferRequest and expects the write: this side then gets one
        terminal event (KVReceived, TransferFailed, or Quiescent after abort()).
        """
        self._check_open()
        dst = check_block_ids(dst_block_ids, self.layout.num_blocks, "dst_block_ids")
        if peer_id not in self._registry.peers:
            raise TransferRejected(f"unknown peer {peer_id!r}")
        self._claim(request_id, peer_id)
        request = TransferRequest(
            request_id=request_id,
            dst_agent=self.agent_name,
            dst_engine_id=self.engine_id,
            dst_block_ids=dst.tolist(),
            transfer_key=transfer_key,
            skip_blocks=skip_blocks,
        )
        cmd = ExpectCmd(IncomingTransfer(request_id, peer_id, dst), request)
        if not self._loop.try_run(cmd, wake=True):
            self._submit(cmd)

    def abort(self, request_id: str) -> bool:
        """Stop the transfer of request_id (either side). False if none is live.

        Sender: queued writes never start; a posted one is cancelled if the backend
        can, else finished. Receiver: asks the sender to stop. Either way the
        terminal event is Quiescent(landed=...) unless the transfer ended first;
        only then may the owner free the blocks. No write for request_id may
        start afterwards.
        """
        if request_id not in self._registry.active:
            return False
        self._submit(AbortCmd(request_id))
        return True

    def send(self, peer_id: str, message: Message) -> None:
        """Send a typed message to a connected peer over the side channel."""
        self._check_open()
        if peer_id not in self._registry.peers:
            raise TransferRejected(f"unknown peer {peer_id!r}")
        cmd = SendCmd(peer_id, message)
        if not self._loop.try_run(cmd, wake=False):
            self._submit(cmd)

    # -- events ------------------------------------------------------------------------------

    def poll_events(self) -> list[TransferEvent]:
        """Every event reported so far, oldest first; never blocks."""
        return self._events.drain()

    def wait_events(self, timeout: float | None = None) -> list[TransferEvent]:
        """Block until at least one event is pending (or timeout), then drain."""
        self._events.wait(timeout)
        return self._events.drain()

    async def next_events(self) -> list[TransferEvent]:
        """asyncio: wait until events are pending, then drain (never blocks the loop)."""
        events = self._events.drain()
        if events or self._closed:
            return events
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(self.fileno(), wake)
        try:
            await ready
        finally:
            loop.remove_reader(self.fileno())
        return self._events.drain()

    def fileno(self) -> int:
        """An fd that is readable while events may be pending (until close())."""
        return self._events.fd

    @property
    def rejected_messages(self) -> int:
        return self._loop.rejected

    @property
    def quarantined(self) -> int:
        """Incoming transfers whose lost sender might still write: their blocks are held."""
        return len(self._loop.book.quarantined)

    @property
    def quarantine_timeouts(self) -> int:
        """Quarantines that ended by time rather than by the sender's answer."""
        return self._loop.book.quarantine_timeouts

    @property
    def step_errors(self) -> int:
        """Progress-thread steps that raised and were survived (each one a bug to report)."""
        return self._loop.step_errors

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the progress thread; unfinished transfers end with TransferFailed(CLOSED)
        (still readable with poll_events()). Idempotent; bounded by close_timeout_s."""
        if self._closed:
            return
        self._closed = True
        self._loop.stopping = True
        self._loop.wake.set()
        limit = 4 * self.config.close_timeout_s  # the backend bounds its own drain by one
        self._thread.join(limit)
        if self._thread.is_alive():  # leave its fds open: closing them under it is worse
            log.error("kv progress thread did not stop within %.1fs", limit)
            return
        self._loop.wake.close()
        self._events.close()
        self._ctx.term()

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as e:
            self._error = e
            log.exception("kv progress thread failed")
        finally:
            try:
                self._loop.shutdown()
            except Exception:
                log.exception("kv progress thread shutdown failed")

    def _claim(self, request_id: str, peer_id: str) -> None:
        if not request_id:
            raise TransferRejected("request_id must be non-empty")
        refused = self._registry.claim(request_id, peer_id)
        if refused is not None:
            raise TransferRejected(refused)

    def _submit(self, cmd: Command) -> None:
        self._check_open()
        self._loop.submit(cmd)

    def failure(self) -> BaseException | None:
        """Why the progress thread stopped on its own; None while it runs, and after close()."""
        if self._closed:
            return None
        if self._error is not None:
            return self._error
        if not self._thread.is_alive():
            return RuntimeError("the progress thread exited")
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosed("the agent is closed")
        if self._error is not None or not self._thread.is_alive():
            raise AgentClosed(f"the progress thread stopped: {self._error!r}")


def _check_fingerprint(fingerprint: Fingerprint, kv_cache: torch.Tensor) -> None:
    """The fingerprint must describe this cache (its layout fields)."""
    actual = Fingerprint.for_kv_cache(kv_cache, fingerprint.weights_hash)
    layout_fields = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
    diffs = [d for d in fingerprint.differences(actual) if d[0] in layout_fields]
    if diffs:
        names = ", ".join(f"{k} (fingerprint {a!r}, cache {b!r})" for k, a, b in diffs)
        raise ValueError(f"fingerprint does not describe the kv_cache: {names}")
