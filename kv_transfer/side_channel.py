"""The pyzmq side channel: handshakes, TransferRequests, control messages, heartbeats.

One ROUTER socket per agent is its inbox; every peer's messages arrive there,
with the peer's agent name as routing id. To each peer the agent opens one
DEALER (its outbox), identity = our agent name, and watches it with a socket
monitor: a killed peer's TCP connection drops at once, which is how peer loss
is usually seen before any heartbeat goes missing. Replies to a connection that
has no outbox yet (handshake replies, rejects) go back through the ROUTER.

With a cluster token, what goes out on a peer's outbox once the handshake is done carries
a second frame, its seal (auth.py); the receiver checks it before it believes the routing id.

All sockets belong to the progress thread (zmq sockets are not thread-safe).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.wire.messages import Message, encode
from kv_transfer.auth import Sealer

log = logging.getLogger(__name__)

_SNDHWM = 100_000  # messages queued per peer before sends would block


@dataclass(frozen=True, slots=True)
class Inbound:
    """A frame that arrived: via our ROUTER (routing_id = sender) or a peer outbox."""

    routing_id: str  # ROUTER: the sender's identity; outbox: the key of that outbox
    payload: bytes
    via_outbox: bool
    seal: bytes | None = None  # the second frame, if any (auth.py)


class Outbox:
    """Sends requested by the transfer book and the backend, flushed after each step by
    the progress thread, or by an owner's thread that ran a command or a small write
    inline (ProgressLoop.try_run, try_inline): always under the state lock, and outbox
    sockets are never polled, so only one thread at a time touches one. Per-peer order is
    issue order."""

    def __init__(self, side: SideChannel) -> None:
        self._side = side
        self._queue: deque[tuple[str, Message]] = deque()

    def send(self, key: str, msg: Message) -> bool:
        """Queue msg for peer `key`; False if there is no connection to it."""
        if not self._side.has(key):
            return False
        self._queue.append((key, msg))
        return True

    def flush(self) -> None:
        while self._queue:
            key, msg = self._queue.popleft()
            self._side.send(key, msg)


@dataclass(frozen=True, slots=True)
class Disconnected:
    key: str  # the outbox whose TCP connection dropped


class SideChannel:
    def __init__(
        self,
        ctx: zmq.Context,
        identity: str,
        host: str,
        port: int,
        poller: zmq.Poller,
        sealer: Sealer | None = None,
    ):
        self._ctx = ctx
        self._identity = identity.encode()
        self._sealer = sealer
        self._sealed: set[str] = set()  # outboxes of handshaken peers: what goes there is sealed
        self._poller = poller
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.RCVHWM, _SNDHWM)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
            bound = port
        else:
            bound = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{bound}"
        poller.register(self._router, zmq.POLLIN)
        self._outboxes: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> outbox key
        self._outbox_keys: dict[zmq.Socket, str] = {}

    # -- outboxes ----------------------------------------------------------------------------

    def open(self, key: str, address: str) -> None:
        """Open (connect) an outbox to a peer's ROUTER at `address`."""
        if key in self._outboxes:
            raise RuntimeError(f"outbox {key!r} is already open")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self._outboxes[key] = sock
        self._outbox_keys[sock] = key
        self._monitors[mon] = key
        self._poller.register(mon, zmq.POLLIN)  # outboxes themselves are not polled: see drain

    def rekey(self, old: str, new: str) -> None:
        sock = self._outboxes.pop(old)
        self._outboxes[new] = sock
        self._outbox_keys[sock] = new
        for mon, key in self._monitors.items():
            if key == old:
                self._monitors[mon] = new

    def has(self, key: str) -> bool:
        return key in self._outboxes

    def seal_to(self, key: str) -> None:
        """From now on, seal what is sent on outbox `key` (its peer passed the handshake)."""
        if self._sealer is not None:
            self._sealed.add(key)

    def close(self, key: str) -> None:
        self._sealed.discard(key)
        sock = self._outboxes.pop(key, None)
        if sock is None:
            return
        del self._outbox_keys[sock]
        for mon in [m for m, k in self._monitors.items() if k == key]:
            del self._monitors[mon]
            self._poller.unregister(mon)
            sock.disable_monitor()
            mon.close(linger=0)
        sock.close(linger=0)

    # -- sending -----------------------------------------------------------------------------

    def send(self, key: str, msg: Message) -> bool:
        """Queue msg on the outbox `key`; False if there is none or its queue is full."""
        sock = self._outboxes.get(key)
        if sock is None:
            return False
        payload = encode(msg)
        try:
            if self._sealer is not None and key in self._sealed:
                sock.send_multipart([payload, self._sealer.seal(key, payload)], zmq.NOBLOCK)
            else:
                sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("side channel to %s is full; dropped %s", key, msg.TYPE)
            return False
        return True

    def reply(self, routing_id: str, msg: Message) -> bool:
        """Send through the ROUTER to a connection identified by routing_id."""
        try:
            self._router.send_multipart([routing_id.encode(), encode(msg)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as e:
            log.debug("reply %s to %s not sent: %s", msg.TYPE, routing_id, e)
            return False
        return True

    # -- receiving ---------------------------------------------------------------------------

    def drain(self, ready: dict[zmq.Socket, int]) -> list[Inbound | Disconnected]:
        """Everything readable on our sockets, in arrival order per socket; replies on
        our outboxes first (a handshake reply precedes what its sender sent next).

        Outboxes are read without being polled: a socket in zmq_poll() must not be used
        by another thread, and an owner's thread may send on outboxes (under the agent's
        state lock) while the progress thread waits in poll. They only ever carry
        handshake replies and rejects, so the progress thread keeps its waits short while
        a handshake is pending."""
        out: list[Inbound | Disconnected] = []
        for sock in list(self._outbox_keys):
            out.extend(self._drain_outbox(sock))
        if self._router in ready:
            out.extend(self._drain_router())
        for mon in [m for m in ready if m in self._monitors]:
            out.extend(self._drain_monitor(mon))
        return out

    def _drain_router(self) -> list[Inbound]:
        out: list[Inbound] = []
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) not in (2, 3):
                log.warning("side channel: dropped a %d-frame message", len(frames))
                continue
            ident = frames[0].decode(errors="replace")
            seal = frames[2] if len(frames) == 3 else None
            out.append(Inbound(ident, frames[1], via_outbox=False, seal=seal))

    def _drain_outbox(self, sock: zmq.Socket) -> list[Inbound]:
        key = self._outbox_keys[sock]
        out: list[Inbound] = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) == 1:
                out.append(Inbound(key, frames[0], via_outbox=True))

    def _drain_monitor(self, mon: zmq.Socket) -> list[Disconnected]:
        out: list[Disconnected] = []
        key = self._monitors[mon]
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return out
            if event["event"] == zmq.EVENT_DISCONNECTED:
                out.append(Disconnected(key))

    def shutdown(self) -> None:
        for key in list(self._outboxes):
            self.close(key)
        self._poller.unregister(self._router)
        self._router.close(linger=0)
