"""Authentication after the handshake: every side-channel message (and every zmq data
message header) carries a seal that only a holder of the cluster token could make.

A peer is identified by the ZeroMQ routing id it picks, and ROUTER_HANDOVER lets a new
connection take an id over, so the routing id alone proves nothing. With a cluster token
each message from agent S to agent R carries

    seal = seq (8 bytes, big-endian) | HMAC-SHA256(key(S -> R), seq | payload)
    key(S -> R) = HMAC-SHA256(token, label | S | R)

where seq grows with every sealed message S sends (on any connection, so it never repeats
while S lives) and R keeps the highest seq it accepted from S: a forged message fails the
HMAC, and a replayed one fails the seq. Agent names carry the process incarnation
(``engine_id-<random>``), so a restarted process has new keys and an old incarnation's
messages are refused. Without a token nothing is sealed (loopback deployments).

Not covered: the bytes of the blocks themselves (nixl writes are one-sided RDMA; zmq and
ucxx payloads follow a sealed header on a connection a stranger cannot splice into), and
anything against a peer that holds the token.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict

from common.wire.messages import PeerInfo, encode_record

_SEQ = struct.Struct(">Q")
TAG_BYTES = 32
SEAL_BYTES = _SEQ.size + TAG_BYTES
_REMEMBERED = 10_000  # senders whose high-water mark is kept (the oldest is forgotten)


def mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"|".join(parts), hashlib.sha256).digest()


def info_digest(info: PeerInfo) -> bytes:
    """What a handshake proof binds: every field of the PeerInfo it carries."""
    return hashlib.sha256(encode_record(info)).digest()


def direction_key(token: bytes, label: bytes, sender: str, receiver: str) -> bytes:
    return mac(token, b"key", label, sender.encode(), receiver.encode())


class Sealer:
    """Seals what one agent sends under one label (its seq is shared by all receivers)."""

    def __init__(self, token: bytes, label: bytes, me: str) -> None:
        self._token, self._label, self._me = token, label, me
        self._keys: dict[str, bytes] = {}
        self._seq = 0

    def seal(self, receiver: str, payload: bytes) -> bytes:
        key = self._keys.get(receiver)
        if key is None:
            key = self._keys[receiver] = direction_key(self._token, self._label, self._me, receiver)
        self._seq += 1
        seq = _SEQ.pack(self._seq)
        return seq + hmac.new(key, seq + payload, hashlib.sha256).digest()


class Opener:
    """Checks seals on what one agent receives under one label."""

    def __init__(self, token: bytes, label: bytes, me: str) -> None:
        self._token, self._label, self._me = token, label, me
        self._keys: dict[str, bytes] = {}
        self._high: OrderedDict[str, int] = OrderedDict()  # sender -> highest seq accepted

    def open(self, sender: str, payload: bytes, seal: bytes | None) -> bool:
        """Whether `payload` was sealed by `sender` for us and is not a replay."""
        if seal is None or len(seal) != SEAL_BYTES:
            return False
        key = self._keys.get(sender)
        if key is None:
            key = direction_key(self._token, self._label, sender, self._me)
            if len(self._keys) >= _REMEMBERED:
                self._keys.pop(next(iter(self._keys)))
            self._keys[sender] = key
        seq_bytes = seal[: _SEQ.size]
        expected = hmac.new(key, seq_bytes + payload, hashlib.sha256).digest()
        if not hmac.compare_digest(seal[_SEQ.size :], expected):
            return False
        (seq,) = _SEQ.unpack(seq_bytes)
        if seq <= self._high.get(sender, 0):
            return False
        self._high[sender] = seq
        self._high.move_to_end(sender)
        while len(self._high) > _REMEMBERED:
            self._high.popitem(last=False)
        return True
