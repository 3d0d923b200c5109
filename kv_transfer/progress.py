"""The progress thread: it touches the sockets, the backend and the transfer records (an
owner's thread does too, under the state lock, only while this thread is idle: small writes,
sends and transfer requests made inline).

One iteration:  poll(side channel, backend sockets, command wakeup)
                -> run queued owner commands
                -> dispatch side-channel messages
                -> backend.progress()
                -> heartbeats, timeouts

How long poll() may block is decided each time: not at all while the backend
has work in flight (then it yields the GIL, or sleeps busy_poll_interval_s),
briefly while a nixl notification is expected, and otherwise until the next
heartbeat (or the idle poll interval, for backends whose completions have no fd).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import zmq

from common.wire.messages import (
    Abort,
    Challenge,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Hello,
    KVAborted,
    Message,
    MessageError,
    Reject,
    RejectCode,
    decode,
)
from kv_transfer.connections import Connections
from kv_transfer.errors import AgentClosed
from kv_transfer.events import MessageReceived
from kv_transfer.shared import Wakeup
from kv_transfer.side_channel import Disconnected, Inbound, Outbox, SideChannel
from kv_transfer.state import IncomingTransfer, OutgoingTransfer
from kv_transfer.transfers import TransferBook

log = logging.getLogger(__name__)

_HOT_S = 0.05  # after activity, poll without blocking this long (nixl notifications)
_MAX_EARLY = 1024
# A step that raises is logged, counted and skipped; this many in a row means the state is
# beyond repair: the thread stops, and the node fails fast (NodeServer.fail) to be restarted.
_MAX_FAILED_STEPS = 100
_BUSY_SLICE_S = 0.0005


@dataclass(frozen=True, slots=True)
class ConnectCmd:
    address: str
    future: Future


@dataclass(frozen=True, slots=True)
class WriteCmd:
    xfer: OutgoingTransfer


@dataclass(frozen=True, slots=True)
class MoreCmd:
    """The next segment of a streamed write."""

    request_id: str
    src_ids: np.ndarray
    dst_ids: np.ndarray
    final: bool


@dataclass(frozen=True, slots=True)
class ExpectCmd:
    incoming: IncomingTransfer
    request: Message


@dataclass(frozen=True, slots=True)
class AbortCmd:
    request_id: str


@dataclass(frozen=True, slots=True)
class SendCmd:
    peer_id: str
    message: Message


Command = ConnectCmd | WriteCmd | MoreCmd | ExpectCmd | AbortCmd | SendCmd


class ProgressLoop:
    def __init__(
        self,
        poller: zmq.Poller,
        side: SideChannel,
        outbox: Outbox,
        conns: Connections,
        book: TransferBook,
        emit: Callable[[MessageReceived], None],
        publish: Callable[[], None],
    ) -> None:
        self.poller, self.side, self.outbox = poller, side, outbox
        # Emitted events are published (the owner woken) only once the state lock is free.
        self.publish = publish
        # Held by the progress thread for each step (not while it waits in poll), and by
        # an owner's thread for an inline write: all the state below is behind it.
        self.state_lock = threading.Lock()
        self.conns, self.book, self.emit = conns, book, emit
        self.backend = book.backend
        self.config = conns.config
        self.commands: deque[Command] = deque()
        self.wake = Wakeup()
        poller.register(self.wake.fd, zmq.POLLIN)
        self.stopping = False
        self.rejected = 0  # side-channel messages refused (malformed, unknown, unexpected)
        self.step_errors = 0  # steps that raised (a bug): logged, counted, survived
        self._hot_until = 0.0
        self._early: deque[tuple[Inbound, Message]] = deque()  # from not-yet-known peers
        self._run_cmd: dict[type, Callable] = {
            ConnectCmd: lambda c: self.conns.connect(c.address, c.future),
            WriteCmd: lambda c: self.book.submit(c.xfer, c.xfer.peer_id in self.conns.peers),
            MoreCmd: lambda c: self.book.more(c.request_id, c.src_ids, c.dst_ids, c.final),
            ExpectCmd: lambda c: self.book.expect(c.incoming, c.request),
            AbortCmd: lambda c: self.book.abort(c.request_id),
            SendCmd: self._send_cmd,
        }
        self._on_msg: dict[type, Callable[[str, Message], None]] = {
            Heartbeat: lambda peer, m: None,
            Abort: self._on_abort,
            KVAborted: self._on_kv_aborted,
            Reject: self._on_reject,
        }

    def submit(self, cmd: Command) -> None:
        """Any thread: queue a command and wake the loop."""
        self.commands.append(cmd)
        self.wake.set()

    @contextmanager
    def _inline(self) -> Iterator[bool]:
        """Owner's thread: True while it holds the state lock with the progress thread idle
        and no command queued ahead (False: leave the work to the command queue). On the way
        out it sends what the work queued, releases the lock and publishes the events."""
        if not self.state_lock.acquire(blocking=False):
            yield False  # the progress thread is mid-step: queue it rather than wait
            return
        try:
            idle = not (self.stopping or self.commands)
            yield idle
            if idle:
                try:
                    self.outbox.flush()
                except Exception:  # as in a step: logged and counted, the owner goes on
                    self.step_errors += 1
                    log.exception("inline flush failed")
        finally:
            self.state_lock.release()
            self.publish()

    def try_run(self, cmd: ExpectCmd | SendCmd, wake: bool) -> bool:
        """Owner's thread: run a command that records state and queues side-channel sends
        now (see `_inline`), so that its message leaves without waiting for the progress
        thread to wake (a cross-thread hop on the KV's path: the TransferRequest, the first
        token). False leaves it to the command queue. `wake`: the progress thread must
        still look (an expected transfer changes how often it polls)."""
        with self._inline() as idle:
            if not idle:
                return False
            try:
                self._run_cmd[type(cmd)](cmd)
            except Exception:  # as in a step: logged and counted, the owner goes on
                self.step_errors += 1
                log.exception("inline %s failed", type(cmd).__name__)
            self._hot_until = time.monotonic() + _HOT_S
        if wake:
            self.wake.set()
        return True

    def try_inline(self, xfer: OutgoingTransfer) -> bool:
        """Owner's thread: post a small write now (see `_inline`; the receiver's KVDone
        leaves with it, without waking the progress thread); False leaves it to the
        command queue."""
        if not self.backend.posts_inline:
            return False
        with self._inline() as idle:
            peer_ready = xfer.peer_id in self.conns.peers
            if not (idle and peer_ready and self.book.nothing_queued_for(xfer.peer_id)):
                return False
            self.book.submit(xfer, peer_alive=True)
            self.book.pump()
            in_flight = self.backend.busy()
        if in_flight:
            self.wake.set()  # progress() must poll it to completion
        return True

    def run(self) -> None:
        failed_in_a_row = 0
        while not self.stopping:
            ready = dict(self.poller.poll(self._timeout_ms()))
            self.state_lock.acquire()
            try:
                self._step(ready)
                failed_in_a_row = 0
            except Exception:
                self.step_errors += 1
                failed_in_a_row += 1
                if failed_in_a_row >= _MAX_FAILED_STEPS:
                    raise
                log.exception("kv progress step failed (%d in a row); going on", failed_in_a_row)
            finally:
                self.state_lock.release()
                self.publish()

    def _step(self, ready: dict) -> None:
        """One pass over everything that may have happened; the state lock is held."""
        if self.wake.fd in ready:
            self.wake.clear()
        activity = self._run_commands()
        self.book.pump()
        inbound = self.side.drain(ready)
        for item in inbound:
            self._on_side_guarded(item)
        if self._early:
            self._replay_early()
        backend_events = self.backend.on_ready(ready) + self._progress_backend()
        self.book.on_backend(backend_events)
        for peer_id in self.book.take_suspects():
            self.conns.lose(
                peer_id, "the transport reported it disconnected", self.config.close_timeout_s
            )
        if activity or inbound or backend_events:
            self._hot_until = time.monotonic() + _HOT_S
        self.conns.housekeeping(time.monotonic())
        self.book.expire_stragglers(self.config.close_timeout_s)
        self.outbox.flush()

    def _progress_backend(self) -> list:
        """Poll the backend; while it has work in flight, keep polling it (up to
        _BUSY_SLICE_S) before looking at sockets again, as a bare polling loop would."""
        events = self.backend.progress()
        if events or not self.backend.busy():
            return events
        if self.config.busy_poll_interval_s:
            time.sleep(self.config.busy_poll_interval_s)
            return self.backend.progress()
        until = time.perf_counter() + _BUSY_SLICE_S
        while not events and self.backend.busy() and time.perf_counter() < until:
            events = self.backend.progress()
        return events

    def _timeout_ms(self) -> int:
        if self.commands or self.backend.busy():
            return 0
        now = time.monotonic()
        expected = self.book.expecting()
        expecting = expected and self.backend.polls_for_landing()
        if expecting and now < self._hot_until:
            return 0
        wait = max(0.0, self.conns.next_deadline() - now)
        if expecting or self.conns.connecting():  # (outbox replies are not polled)
            interval = 0.001
        elif expected:
            interval = self.config.idle_poll_interval_s
        else:  # nothing to move: heartbeats and commands (eventfd) wake us
            interval = self.config.quiet_poll_interval_s
        return max(1, int(min(wait, interval) * 1000))

    def _run_commands(self) -> bool:
        ran = False
        while self.commands:
            cmd = self.commands.popleft()
            self._run_cmd[type(cmd)](cmd)
            ran = True
        return ran

    def _send_cmd(self, cmd: SendCmd) -> None:
        if not self.outbox.send(cmd.peer_id, cmd.message):
            log.warning("message %s to %s not sent (peer gone)", cmd.message.TYPE, cmd.peer_id)

    # -- side channel ------------------------------------------------------------------------

    def _on_side_guarded(self, item: Inbound | Disconnected) -> None:
        """A peer's message must never take the progress thread down with it."""
        try:
            self._on_side(item)
        except Exception:
            self.rejected += 1
            log.exception(
                "side-channel message from %s failed; dropped",
                item.key if isinstance(item, Disconnected) else item.routing_id,
            )

    def _on_side(self, item: Inbound | Disconnected) -> None:
        if isinstance(item, Disconnected):
            self.conns.on_disconnected(item.key)
            return
        try:
            msg = decode(item.payload, self.config.max_message_bytes)
        except MessageError as e:
            self._reject(item, str(e))
            return
        if item.via_outbox:
            self._on_outbox(item.routing_id, msg)
        elif isinstance(msg, Hello):
            self.conns.on_hello(item.routing_id, msg)
        elif isinstance(msg, Handshake):
            self.conns.on_handshake(item.routing_id, msg)
        elif item.routing_id in self.conns.peers:
            if not self.conns.authentic(item.routing_id, item.payload, item.seal):
                self._reject(item, "not sealed by that peer, or replayed", "unauthenticated")
            elif self.conns.seen(item.routing_id):
                self._on_peer_message(item.routing_id, msg)
        elif self._may_be_early(item.routing_id) and len(self._early) < _MAX_EARLY:
            # A peer that just accepted our handshake may speak before its reply is read.
            self._early.append((item, msg))
        else:
            self._refuse_unknown(item)

    def _replay_early(self) -> None:
        """Deliver stashed messages whose sender is now a peer; refuse the rest once
        no handshake is pending any more."""
        keep: deque[tuple[Inbound, Message]] = deque()
        for item, msg in self._early:
            if item.routing_id in self.conns.peers:
                if not self.conns.authentic(item.routing_id, item.payload, item.seal):
                    self._reject(item, "not sealed by that peer, or replayed", "unauthenticated")
                elif self.conns.seen(item.routing_id):
                    self._on_peer_message(item.routing_id, msg)
            elif self._may_be_early(item.routing_id):
                keep.append((item, msg))
            else:
                self._refuse_unknown(item)
        self._early = keep

    def _may_be_early(self, sender: str) -> bool:
        """Whether a message from a sender that is no peer may be ahead of a handshake's
        reply: some handshake is pending, and, for a peer we declared lost, it is the one
        to that peer's address. (Refused as lost instead, a reconnected peer's first
        heartbeat made it declare us lost in turn, just as its reply made it our peer.)"""
        if self.conns.was_lost(sender):
            return self.conns.redialling(sender)
        return self.conns.connecting()

    def _refuse_unknown(self, item: Inbound) -> None:
        if self.conns.was_lost(item.routing_id):
            self._reject(item, "this node declared you lost; handshake again", "peer_lost")
        else:
            self._reject(item, f"unknown peer {item.routing_id!r}: handshake first", "unknown_peer")

    def _on_outbox(self, key: str, msg: Message) -> None:
        """Replies that come back on our own outbox: handshake replies and rejects."""
        if isinstance(msg, HandshakeReply):
            self.conns.on_reply(key, msg)
        elif isinstance(msg, Challenge):
            self.conns.on_challenge(key, msg)
        elif isinstance(msg, Reject):
            self.conns.on_reject(key, msg)
        else:
            log.warning("unexpected %s on outbox %s dropped", msg.TYPE, key)

    def _on_peer_message(self, peer_id: str, msg: Message) -> None:
        handler = self._on_msg.get(type(msg))
        if handler is not None:
            handler(peer_id, msg)
            return
        events = self.backend.on_message(peer_id, msg)
        if events is not None:
            self.book.on_backend(events)
        elif isinstance(msg, HandshakeReply):
            log.warning("unexpected handshake reply from %s dropped", peer_id)
        else:
            self.emit(MessageReceived(peer_id, msg))

    def _on_abort(self, peer_id: str, msg: Message) -> None:
        assert isinstance(msg, Abort)
        self.book.on_peer_abort(peer_id, msg.request_id)
        self.emit(MessageReceived(peer_id, msg))

    def _on_kv_aborted(self, peer_id: str, msg: Message) -> None:
        assert isinstance(msg, KVAborted)
        events = self.backend.on_message(peer_id, msg)  # the receiver refused our write?
        if events is not None:
            self.book.on_backend(events)
        else:
            self.book.on_peer_aborted(peer_id, msg)

    def _on_reject(self, peer_id: str, msg: Message) -> None:
        assert isinstance(msg, Reject)
        self.conns.on_reject(peer_id, msg)

    def _reject(self, item: Inbound, reason: str, code: RejectCode = "malformed") -> None:
        self.rejected += 1
        log.warning("rejected side-channel message from %s: %s", item.routing_id, reason)
        if not item.via_outbox:
            self.side.reply(item.routing_id, Reject(code=code, reason=reason[:1000]))

    # -- shutdown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Run on the progress thread after run() returns (or raised)."""
        try:
            with self.state_lock:
                self._shutdown()
        finally:
            self.publish()

    def _shutdown(self) -> None:
        try:
            self._run_commands_on_close()
            self.conns.close()
            self.book.close()
        finally:
            try:
                self.backend.close()
            finally:
                self.side.shutdown()
                self.poller.unregister(self.wake.fd)  # the agent closes it after join()

    def _run_commands_on_close(self) -> None:
        """Commands that arrived too late still get their answer."""
        while self.commands:
            cmd = self.commands.popleft()
            if isinstance(cmd, ConnectCmd) and not cmd.future.done():
                cmd.future.set_exception(AgentClosed("agent closed"))
            elif isinstance(cmd, WriteCmd):
                self.book.refuse(cmd.xfer.request_id, cmd.xfer.peer_id, "agent closed")
            elif isinstance(cmd, ExpectCmd):
                self.book.refuse(cmd.incoming.request_id, cmd.incoming.peer_id, "agent closed")
