"""Every cross-process message record, and the one encoder/decoder for them.

Wire format: one msgpack map per message, carrying the model's fields plus
``type`` (a tag unique per record) and ``version`` (the protocol version).
Decoding dispatches on ``type`` through a dict; the peer is never trusted to
name code to run, so nothing here unpickles or looks names up with getattr.

Sections: encoding, KV-transfer handshake, KV-transfer control, liveness and
errors. Node-level records (PrefillRequest, PrefillResult, DecodeRequest,
KVHandle) belong here too, in their own section.
"""

from __future__ import annotations

from typing import ClassVar, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.wire.fingerprint import PROTOCOL_VERSION, Fingerprint

DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**20

# -- encoding --------------------------------------------------------------------------------


class MessageError(ValueError):
    """Bytes that are not a valid message: malformed, unknown type, wrong version."""


class Message(BaseModel):
    """Base of every record. Subclasses declare ``type: Literal[...]`` and register."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    TYPE: ClassVar[str] = ""
    version: int = PROTOCOL_VERSION


M = TypeVar("M", bound=Message)

_REGISTRY: dict[str, type[Message]] = {}


def register(cls: type[M]) -> type[M]:
    """Class decorator: make `cls` decodable under its ``type`` tag."""
    tag = cls.model_fields["type"].default
    if not tag or tag in _REGISTRY:
        raise TypeError(f"message type tag {tag!r} is missing or already registered")
    cls.TYPE = tag
    _REGISTRY[tag] = cls
    return cls


def encode(msg: Message) -> bytes:
    return encode_record(msg)


def encode_record(record: BaseModel) -> bytes:
    """Any record's fields as msgpack, in declaration order (deterministic: a digest of it
    is the same on both ends of a handshake)."""
    return msgpack.packb(record.model_dump(mode="python"), use_bin_type=True)


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Bytes -> typed record; raises MessageError with the reason on any defect."""
    if len(data) > max_bytes:
        raise MessageError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise MessageError(f"not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise MessageError(f"a message must be a map, got {type(obj).__name__}")
    tag, version = obj.get("type"), obj.get("version")
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {tag!r}")
    if version != PROTOCOL_VERSION:
        raise MessageError(
            f"{tag}: unsupported protocol version {version!r} (this node speaks {PROTOCOL_VERSION})"
        )
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        fields = ", ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise MessageError(f"invalid {tag}: {fields}"[:500]) from None


# -- KV-transfer handshake -------------------------------------------------------------------


MemoryKind = Literal["DRAM", "VRAM"]  # NIXL's names: host memory, a GPU's memory


class KVRegion(BaseModel):
    """A node's registered KV cache: block i is [base_addr + i*block_bytes, +block_bytes),
    in host memory (DRAM) or on GPU `device_id` (VRAM)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_addr: int = Field(ge=0)
    num_blocks: int = Field(gt=0)
    block_bytes: int = Field(gt=0)
    device_id: int = Field(default=0, ge=0)
    memory: MemoryKind = "DRAM"


class PeerInfo(BaseModel):
    """What one KV-transfer agent tells another about itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_name: str = Field(min_length=1, max_length=256)  # unique per process instance
    engine_id: str = Field(min_length=1, max_length=256)
    side_channel: str  # zmq endpoint of its ROUTER, e.g. tcp://127.0.0.1:5555
    backend: Literal["nixl", "ucxx", "zmq"]
    backend_metadata: bytes  # nixl agent metadata / ucx worker address / zmq data endpoint
    region: KVRegion
    fingerprint: Fingerprint
    # Receiver-assigned id for the other side's data channel (ucxx tags use it as high bits).
    channel_id: int = Field(default=0, ge=0, lt=2**20)
    # New at every process start (the agent name ends with it): a peer that comes back at
    # the same address with a new incarnation replaces the old one at once.
    incarnation: str = Field(default="", max_length=64)


@register
class Hello(Message):
    """The first message of an authenticated handshake: who is asking, and a fresh nonce.
    It carries nothing a stranger could use."""

    type: Literal["hello"] = "hello"
    agent_name: str = Field(min_length=1, max_length=256)
    nonce: bytes = Field(min_length=16, max_length=64)


@register
class Challenge(Message):
    """The answer to a Hello: the answerer's own nonce, and its proof that it holds the
    cluster token (an HMAC over both nonces)."""

    type: Literal["challenge"] = "challenge"
    nonce: bytes = Field(min_length=16, max_length=64)
    proof: bytes = Field(min_length=32, max_length=32)


@register
class Handshake(Message):
    type: Literal["handshake"] = "handshake"
    peer: PeerInfo
    proof: bytes | None = Field(default=None, max_length=32)  # after a Challenge: ours


@register
class HandshakeReply(Message):
    type: Literal["handshake_reply"] = "handshake_reply"
    accepted: bool
    error: str | None = None
    peer: PeerInfo | None = None  # set when accepted
    # After a Challenge: the answerer's proof over both nonces and its PeerInfo, so nobody
    # on the path can swap the info (addresses, memory keys) it carries.
    proof: bytes | None = Field(default=None, max_length=32)


# -- KV-transfer control ---------------------------------------------------------------------


@register
class TransferRequest(Message):
    """Decode -> prefill: write request_id's KV into these (reserved) blocks of dst_agent."""

    type: Literal["transfer_request"] = "transfer_request"
    request_id: str = Field(min_length=1)
    dst_agent: str
    dst_engine_id: str
    dst_block_ids: list[int]
    # The held KV's capability (KVHandle.transfer_key); the prefill node refuses without it.
    transfer_key: str = Field(default="", max_length=128, repr=False)
    # Leading blocks of the held KV the receiver has already (its prefix cache): the write
    # covers the held blocks from this one on, into dst_block_ids.
    skip_blocks: int = Field(default=0, ge=0)


@register
class BlockWrite(Message):
    """Header of a two-sided write (ucxx, zmq): which destination blocks the data fills."""

    type: Literal["block_write"] = "block_write"
    request_id: str = Field(min_length=1)
    src_agent: str
    xfer_id: int = Field(ge=0)
    dst_block_ids: list[int]  # the blocks this message carries (zmq: one part's worth)
    part: int = Field(default=0, ge=0)  # zmq: a write is sent as `parts` messages, each whole
    parts: int = Field(default=1, ge=1)


@register
class KVDone(Message):
    """The write for request_id has landed (nixl notification, or receiver -> sender ack)."""

    type: Literal["kv_done"] = "kv_done"
    request_id: str = Field(min_length=1)
    # The blocks this write carried; 0: all of the transfer. A streamed transfer lands as
    # several writes, and the receiver counts them until every reserved block is in.
    num_blocks: int = Field(default=0, ge=0)


@register
class KVFirstToken(Message):
    """Prefill -> decode, in a streamed transfer: the first token was sampled (at the
    sender's wall-clock `sampled_at`); the decode node admits once it and the KV are in."""

    type: Literal["kv_first_token"] = "kv_first_token"
    request_id: str = Field(min_length=1)
    token_id: int = Field(ge=0)
    sampled_at: float = 0.0


@register
class KVAborted(Message):
    """No write for request_id will land (anymore); the destination blocks may be freed."""

    type: Literal["kv_aborted"] = "kv_aborted"
    request_id: str = Field(min_length=1)
    reason: str = ""


@register
class Abort(Message):
    """Decode -> prefill: stop (or finish) the write for request_id, then say KVAborted."""

    type: Literal["abort"] = "abort"
    request_id: str = Field(min_length=1)


@register
class Cancel(Message):
    """Proxy -> node: the client is gone; end request_id and free what it holds. With
    `choice` (a request of several, n > 1): end that choice only (the client is done with
    it, e.g. at a stop string); the others go on."""

    type: Literal["cancel"] = "cancel"
    request_id: str = Field(min_length=1)
    choice: int | None = Field(default=None, ge=0)


@register
class Release(Message):
    """The sender no longer holds request_id's blocks (lease expired, cancel, error)."""

    type: Literal["release"] = "release"
    request_id: str = Field(min_length=1)
    reason: str


# -- liveness and errors ---------------------------------------------------------------------


@register
class Heartbeat(Message):
    type: Literal["heartbeat"] = "heartbeat"
    agent_name: str
    sent_at: float  # sender's wall clock, for logs only


RejectCode = Literal["malformed", "unknown_peer", "peer_lost", "unauthenticated"]


@register
class Reject(Message):
    """Reply to a message the receiver refused.

    code: malformed (undecodable, unknown type, wrong version); unknown_peer (no
    handshake yet); unauthenticated (not sealed by the peer it names, or replayed);
    peer_lost (the receiver declared the sender lost: it must consider the receiver lost
    too, and handshake again).
    """

    type: Literal["reject"] = "reject"
    code: RejectCode = "malformed"
    reason: str
