"""Peers of one agent: handshakes, heartbeats, loss detection. Progress thread only.

Handshake (A connects to B; both ends check everything):

    A: open outbox to B ──Handshake{A's PeerInfo}──> B's ROUTER
    B: fingerprint, backend and layout must match, else HandshakeReply{accepted=false,
       error, B's info}; if they do: add A to the backend, open an outbox to A,
       reply HandshakeReply{accepted=true, B's info} (through the ROUTER)
    A: checks B's info the same way, adds B to the backend, connect() returns B's id

With a cluster token (TransferConfig.cluster_token) two messages come first, and no
PeerInfo moves before both sides proved they hold the token:

    A ──Hello{A's name, nonce_a}──> B
    B ──Challenge{nonce_b, HMAC(token, "challenge" | nonce_a | nonce_b)}──> A
    A: checks B's proof, then ──Handshake{A's PeerInfo, HMAC(token, "handshake" | nonce_b |
       nonce_a | A's name | sha256(A's PeerInfo))}──> B
    B: checks A's proof (against the nonce it issued to that connection), then as above; its
       HandshakeReply carries HMAC(token, "accept" | nonce_a | nonce_b | sha256(B's PeerInfo)).

A refusal to a peer that did not prove the token carries no PeerInfo. After the handshake
every message between the two is sealed (auth.py): the routing id alone is never believed.

Incarnations: an agent's name ends with its incarnation, new at every process start. A
handshake from a new incarnation of an engine at the address of a connected peer replaces
that peer at once (the old process no longer holds the address). A handshake from a peer
that is still connected (it dropped us first: it declared us lost while we were stopped)
ends the old connection, as if lost, and starts a clean one.

A peer is lost when its outbox's TCP connection drops (a killed process), when
nothing arrived from it for peer_timeout_s (heartbeats every
heartbeat_interval_s), or when the backend reports it disconnected.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from common.wire.fingerprint import FingerprintMismatch
from common.wire.messages import (
    Challenge,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Hello,
    PeerInfo,
    Reject,
)
from kv_transfer.auth import Opener, info_digest, mac
from kv_transfer.backends.base import Backend
from kv_transfer.config import TransferConfig
from kv_transfer.errors import HandshakeError, TransportError
from kv_transfer.events import PeerConnected, PeerLost, TransferEvent
from kv_transfer.shared import Registry
from kv_transfer.side_channel import SideChannel
from kv_transfer.transfers import TransferBook

log = logging.getLogger(__name__)

_MAX_CHANNEL = 2**20
_CLOSING = "agent closed"
_NONCE_BYTES = 32
_MAX_CHALLENGES = 1024  # outstanding challenges kept; the oldest is dropped beyond
_UNAUTHENTICATED = "authentication failed: this agent requires the cluster token"


@dataclass
class Peer:
    info: PeerInfo
    recv_channel: int  # the id we assigned to its writes into us
    last_seen: float


@dataclass
class PendingConnect:
    address: str
    channel: int
    deadline: float
    futures: list[Future] = field(default_factory=list)
    nonce: bytes = b""  # ours, sent in the Hello (authenticated handshakes)
    their_nonce: bytes = b""  # the answerer's, from its Challenge


_REDIAL_INTERVALS = 2  # heartbeat intervals between redials of a lost sender


class Connections:
    def __init__(
        self,
        me: PeerInfo,
        side: SideChannel,
        backend: Backend,
        book: TransferBook,
        registry: Registry,
        emit: Callable[[TransferEvent], None],
        config: TransferConfig,
    ) -> None:
        self.me, self.side, self.backend, self.book = me, side, backend, book
        self.registry, self.emit, self.config = registry, emit, config
        self.peers: dict[str, Peer] = {}
        self._pending: dict[str, PendingConnect] = {}  # outbox key -> attempt
        self._next_channel = 1
        self._next_heartbeat = 0.0
        self._next_redial = 0.0
        # Bounded memory of lost peers: id -> (engine id, side channel), its place
        self._lost_ids: OrderedDict[str, tuple[str, str]] = OrderedDict()
        token = config.cluster_token
        self._token = token.encode() if token is not None else None
        self._opener = None if self._token is None else Opener(self._token, b"side", me.agent_name)
        # routing id -> (their nonce, our nonce, deadline): challenges we issued
        self._challenges: OrderedDict[str, tuple[bytes, bytes, float]] = OrderedDict()

    # -- outbound ----------------------------------------------------------------------------

    def connect(self, address: str, future: Future) -> None:
        for peer_id, peer in self.peers.items():
            if peer.info.side_channel == address:
                future.set_result(peer_id)
                return
        for attempt in self._pending.values():
            if attempt.address == address:
                attempt.futures.append(future)
                return
        key = f"pending:{address}"
        attempt = PendingConnect(
            address, self._channel(), time.monotonic() + self.config.handshake_timeout_s, [future]
        )
        self._pending[key] = attempt
        self.side.open(key, address)
        if self._token is None:
            self.side.send(key, self._handshake(attempt))
            return
        attempt.nonce = os.urandom(_NONCE_BYTES)
        self.side.send(key, Hello(agent_name=self.me.agent_name, nonce=attempt.nonce))

    def on_challenge(self, key: str, msg: Challenge) -> None:
        """B's answer to our Hello: check its proof, then send our info with ours."""
        attempt = self._pending.get(key)
        if attempt is None or self._token is None or not attempt.nonce:
            log.debug("challenge on %s for no pending authenticated connect", key)
            return
        if not hmac.compare_digest(
            msg.proof, mac(self._token, b"challenge", attempt.nonce, msg.nonce)
        ):
            del self._pending[key]
            self.side.close(key)
            _fail(
                attempt.futures,
                HandshakeError(f"{attempt.address} failed authentication (wrong cluster token?)"),
            )
            return
        attempt.their_nonce = msg.nonce
        self.side.send(key, self._handshake(attempt))

    def _handshake(self, attempt: PendingConnect) -> Handshake:
        me = self.me.model_copy(update={"channel_id": attempt.channel})
        proof = None
        if self._token is not None:
            name = me.agent_name.encode()
            parts = (attempt.their_nonce, attempt.nonce, name, info_digest(me))
            proof = mac(self._token, b"handshake", *parts)
        return Handshake(peer=me, proof=proof)

    def on_reply(self, key: str, reply: HandshakeReply) -> None:
        attempt = self._pending.pop(key, None)
        if attempt is None:
            log.debug("handshake reply on %s for no pending connect", key)
            return
        try:
            if reply.peer is None:
                raise HandshakeError(f"{attempt.address} refused the handshake: {reply.error}")
            self._check(reply.peer)  # our own view of any mismatch comes first
            if not reply.accepted:
                raise HandshakeError(f"{attempt.address} refused the handshake: {reply.error}")
            if self._token is not None:
                parts = (attempt.nonce, attempt.their_nonce, info_digest(reply.peer))
                expected = mac(self._token, b"accept", *parts)
                if reply.proof is None or not hmac.compare_digest(reply.proof, expected):
                    raise HandshakeError(f"{attempt.address}: the reply failed authentication")
            self._add(reply.peer, attempt.channel, key)
        except (HandshakeError, TransportError) as e:
            self.side.close(key)
            _fail(attempt.futures, HandshakeError(str(e)))
            return
        _resolve(attempt.futures, reply.peer.agent_name)

    # -- inbound -----------------------------------------------------------------------------

    def on_hello(self, routing_id: str, msg: Hello) -> None:
        """A's first message: answer with our nonce and our proof; remember what we issued."""
        if self._token is None:
            error = "this agent has no cluster token: connect without one"
            self.side.reply(routing_id, HandshakeReply(accepted=False, error=error))
            return
        if routing_id != msg.agent_name:
            self.side.reply(routing_id, HandshakeReply(accepted=False, error=_UNAUTHENTICATED))
            return
        nonce = os.urandom(_NONCE_BYTES)
        deadline = time.monotonic() + self.config.handshake_timeout_s
        self._challenges[routing_id] = (msg.nonce, nonce, deadline)
        self._challenges.move_to_end(routing_id)
        while len(self._challenges) > _MAX_CHALLENGES:
            self._challenges.popitem(last=False)
        proof = mac(self._token, b"challenge", msg.nonce, nonce)
        self.side.reply(routing_id, Challenge(nonce=nonce, proof=proof))

    def _authenticated(self, routing_id: str, hs: Handshake) -> tuple[bytes, bytes] | None:
        """(their nonce, ours) if the handshake answers a challenge we issued to this
        connection, else None; (b"", b"") without a token."""
        if self._token is None:
            return b"", b""
        issued = self._challenges.pop(routing_id, None)
        if issued is None or hs.proof is None or time.monotonic() > issued[2]:
            return None
        theirs, ours, _ = issued
        parts = (ours, theirs, hs.peer.agent_name.encode(), info_digest(hs.peer))
        if not hmac.compare_digest(hs.proof, mac(self._token, b"handshake", *parts)):
            return None
        return theirs, ours

    def on_handshake(self, routing_id: str, hs: Handshake) -> None:
        info = hs.peer
        nonces = self._authenticated(routing_id, hs)
        if nonces is None:
            log.warning("refused an unauthenticated handshake from %r", routing_id)
            self.side.reply(routing_id, HandshakeReply(accepted=False, error=_UNAUTHENTICATED))
            return
        if info.agent_name in self.peers:
            # It connects again, so its side dropped ours (it declared us lost while we were
            # stopped, say, before we noticed): start over from a clean connection, as it
            # does. Answering on the old one would keep stale channels and outboxes.
            self.lose(info.agent_name, "it connected again", self.config.close_timeout_s)
        crossing = self._crossing(info.side_channel)  # both sides connecting at once
        try:
            if routing_id != info.agent_name:
                raise HandshakeError(f"identity {routing_id!r} is not agent {info.agent_name!r}")
            self._check(info)
        except HandshakeError as e:
            log.warning("refused handshake from %s: %s", routing_id, e)
            self.side.reply(routing_id, HandshakeReply(accepted=False, error=str(e), peer=self.me))
            return
        if crossing is None:
            key, channel = f"inbound:{info.agent_name}", self._channel()
            self.side.open(key, info.side_channel)
        else:
            key, channel = crossing, self._pending[crossing].channel
        try:
            self._add(info, channel, key)
        except TransportError as e:
            self.side.close(key)
            self.side.reply(routing_id, HandshakeReply(accepted=False, error=str(e), peer=self.me))
            return
        self._accept(routing_id, channel, nonces)
        if crossing is not None:
            _resolve(self._pending.pop(crossing).futures, info.agent_name)

    def authentic(self, peer_id: str, payload: bytes, seal: bytes | None) -> bool:
        """Whether a message that names peer_id as its sender was sealed by it (and is no
        replay); always True without a token."""
        return self._opener is None or self._opener.open(peer_id, payload, seal)

    def seen(self, peer_id: str) -> bool:
        """Record that peer_id spoke; False if it is not a connected peer."""
        peer = self.peers.get(peer_id)
        if peer is None:
            return False
        peer.last_seen = time.monotonic()
        return True

    def on_disconnected(self, key: str) -> None:
        if key in self.peers:
            # The peer's process closed its socket (it exited, most likely): what it had
            # posted drains within the close timeout, not the full quarantine.
            self.lose(key, "side-channel connection dropped", self.config.close_timeout_s)
        elif key in self._pending:
            attempt = self._pending.pop(key)
            self.side.close(key)
            _fail(attempt.futures, HandshakeError(f"{attempt.address} dropped the connection"))

    def on_reject(self, key: str, msg: Reject) -> None:
        log.warning("peer %s rejected a message (%s): %s", key, msg.code, msg.reason)
        if key in self.peers and msg.code == "peer_lost":
            self.lose(key, f"the peer declared us lost: {msg.reason}")

    def was_lost(self, peer_id: str) -> bool:
        return peer_id in self._lost_ids

    def connecting(self) -> bool:
        return bool(self._pending)

    def redialling(self, peer_id: str) -> bool:
        """Whether peer_id was lost and a handshake to its address is pending: what it says
        now may come from the connection that handshake is opening."""
        place = self._lost_ids.get(peer_id)
        return place is not None and any(a.address == place[1] for a in self._pending.values())

    # -- liveness ----------------------------------------------------------------------------

    def housekeeping(self, now: float) -> None:
        for routing_id, (_, _, deadline) in list(self._challenges.items()):
            if now > deadline:
                del self._challenges[routing_id]
        for key, attempt in list(self._pending.items()):
            if now > attempt.deadline:
                del self._pending[key]
                self.side.close(key)
                _fail(
                    attempt.futures, HandshakeError(f"handshake with {attempt.address} timed out")
                )
        for peer_id, peer in list(self.peers.items()):
            silent = now - peer.last_seen
            if silent > self.config.peer_timeout_s:
                self.lose(peer_id, f"no message for {silent:.1f}s")
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval_s
            beat = Heartbeat(agent_name=self.me.agent_name, sent_at=time.time())
            for peer_id in self.peers:
                self.side.send(peer_id, beat)
        if now >= self._next_redial:
            self._next_redial = now + _REDIAL_INTERVALS * self.config.heartbeat_interval_s
            self._redial_quarantined()

    def _redial_quarantined(self) -> None:
        """Dial the lost senders of quarantined writes: the handshake's answer (the re-sent
        Abort in book.peer_connected) is what ends a quarantine early, and without this it
        came only with the next transfer from that sender, which may never be asked for.
        Nothing waits on these connects; one that fails is tried again next interval."""
        for peer_id in self.book.quarantined_peers():
            place = self._lost_ids.get(peer_id)
            if place is None or peer_id in self.peers or self.redialling(peer_id):
                continue
            log.info("redialling %s at %s: it holds quarantined writes to us", peer_id, place[1])
            self.connect(place[1], Future())

    def next_deadline(self) -> float:
        return self._next_heartbeat

    def lose(self, peer_id: str, reason: str, quarantine_s: float | None = None) -> None:
        """Declare peer_id lost; what it was writing into us is quarantined for quarantine_s
        (default: config.quarantine_timeout_s) unless it answers or is replaced first."""
        peer = self.peers.pop(peer_id, None)
        if peer is None:
            return
        level = logging.INFO if reason == _CLOSING else logging.WARNING
        log.log(level, "peer %s lost: %s", peer_id, reason)
        self._lost_ids[peer_id] = (peer.info.engine_id, peer.info.side_channel)
        if len(self._lost_ids) > 10_000:
            self._lost_ids.popitem(last=False)
        self.registry.remove_peer(peer_id)
        self.side.close(peer_id)
        if quarantine_s is None:
            quarantine_s = self.config.quarantine_timeout_s
        self.book.fail_peer(peer_id, reason, quarantine_s)
        self.emit(PeerLost(peer_id, reason))

    def close(self) -> None:
        for key, attempt in list(self._pending.items()):
            self.side.close(key)
            _fail(attempt.futures, HandshakeError("agent closed"))
        self._pending.clear()
        for peer_id in list(self.peers):
            self.lose(peer_id, _CLOSING)

    # -- internals ---------------------------------------------------------------------------

    def _check(self, info: PeerInfo) -> None:
        try:
            self.me.fingerprint.check_compatible(info.fingerprint)
        except FingerprintMismatch as e:
            raise HandshakeError(f"peer {info.agent_name}: {e}") from None
        if info.backend != self.me.backend:
            raise HandshakeError(
                f"peer {info.agent_name}: backend differs (ours {self.me.backend!r}, "
                f"theirs {info.backend!r})"
            )
        if info.region.block_bytes != self.me.region.block_bytes:
            raise HandshakeError(
                f"peer {info.agent_name}: block_bytes differs (ours {self.me.region.block_bytes}, "
                f"theirs {info.region.block_bytes})"
            )

    def _add(self, info: PeerInfo, recv_channel: int, outbox_key: str) -> None:
        place = (info.engine_id, info.side_channel)
        for old_id, old in list(self.peers.items()):
            if (old.info.engine_id, old.info.side_channel) == place and old_id != info.agent_name:
                self.lose(old_id, f"replaced by a new incarnation ({info.agent_name})")
        for old_id, old_place in list(self._lost_ids.items()):
            if old_place == place and old_id != info.agent_name:
                self.book.peer_replaced(old_id)
        self.backend.add_peer(info, send_channel=info.channel_id, recv_channel=recv_channel)
        self._lost_ids.pop(info.agent_name, None)
        self.side.rekey(outbox_key, info.agent_name)
        self.side.seal_to(info.agent_name)
        self.book.peer_connected(info.agent_name)  # (it may send to the peer)
        self.peers[info.agent_name] = Peer(info, recv_channel, time.monotonic())
        self.registry.add_peer(info.agent_name, info.region, info.side_channel)
        self.emit(PeerConnected(info.agent_name, info.engine_id))

    def _crossing(self, address: str) -> str | None:
        """The key of our own pending connect to `address`, if any."""
        for key, attempt in self._pending.items():
            if attempt.address == address:
                return key
        return None

    def _accept(self, routing_id: str, channel: int, nonces: tuple[bytes, bytes]) -> None:
        me = self.me.model_copy(update={"channel_id": channel})
        proof = None
        if self._token is not None:
            theirs, ours = nonces
            proof = mac(self._token, b"accept", theirs, ours, info_digest(me))
        self.side.reply(routing_id, HandshakeReply(accepted=True, peer=me, proof=proof))

    def _channel(self) -> int:
        channel = self._next_channel
        self._next_channel = self._next_channel % (_MAX_CHANNEL - 1) + 1
        return channel


def _resolve(futures: list[Future], value: str) -> None:
    for f in futures:
        if not f.done():
            f.set_result(value)


def _fail(futures: list[Future], error: Exception) -> None:
    for f in futures:
        if not f.done():
            f.set_exception(error)
