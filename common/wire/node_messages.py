"""Records of the internal HTTP API between the proxy and the nodes.

They share `common.wire.messages`' registry, type tags and protocol version; over
HTTP they travel as JSON (`to_json` / `from_json`), one record per body, or one
per line in a token stream (NDJSON).

Internal API (every node: GET /health, GET /state, GET /metrics):

    prefill  POST /internal/prefill   PrefillRequest -> PrefillResult
             POST /internal/prefill_streamed  PrefillRequest -> 200 NDJSON: PrefillAccepted
                                      (the KV handle, after the first chunk: the KV streams to the
                                      decode node that asks while the prompt computes), then
                                      PrefillResult, or a TokenDelta with the error
             POST /internal/extend    LeaseExtend    -> LeaseExtendResult
    decode   POST /internal/decode    DecodeRequest  -> 200 NDJSON TokenDelta stream,
                                                        or 503 code "decode_full"
    both     POST /internal/generate  GenerateRequest -> 200 NDJSON TokenDelta stream
    all      POST /internal/cancel    Cancel         -> CancelResult
             POST /internal/role      RoleChange     -> RoleChangeResult (drains, switches)

A role's work (PrefillRequest, DecodeRequest, GenerateRequest) may carry the node epoch the
proxy saw (`/state` reports it; each role change bumps it): a node at another epoch answers
409 "stale_epoch", and a path the node's current role does not serve 409 "wrong_role"; either
way the node did not take the request.

Errors are OpenAI-style bodies {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.wire.fingerprint import PROTOCOL_VERSION
from common.wire.logprobs import TokenLogprobs
from common.wire.messages import Message, MessageError, register
from common.wire.sampling_params import SamplingParams
from common.wire.stage import Stage

FinishReasonName = Literal["stop", "length", "abort"]

T = TypeVar("T", bound=Message)


def to_json(msg: Message) -> bytes:
    return msg.model_dump_json().encode()


def from_json(data: bytes | str, cls: type[T]) -> T:
    """Parse one `cls` record; raises MessageError naming what is wrong."""
    try:
        msg = cls.model_validate_json(data)
    except ValidationError as e:
        fields = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()
        )
        raise MessageError(f"invalid {cls.TYPE}: {fields}"[:500]) from None
    if msg.version != PROTOCOL_VERSION:
        raise MessageError(
            f"{cls.TYPE}: protocol version {msg.version}, expected {PROTOCOL_VERSION}"
        )
    return msg


class KVHandle(BaseModel):
    """Where a prefilled request's KV is held, and until when."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_id: str
    side_channel: str  # the prefill node's KV-transfer side channel (zmq endpoint)
    num_blocks: int = Field(gt=0)
    num_tokens: int = Field(gt=0)  # KV of this many prompt tokens
    lease_deadline: float  # unix time; the blocks are freed after it unless extended
    # The capability to take this KV: unguessable, given to the decode node the proxy chose
    # (in its DecodeRequest) and required in its TransferRequest.
    transfer_key: str = Field(min_length=16, max_length=128, repr=False)


# A boundary a node saw, for the request's ownership trace: (event, wall-clock seconds).
NodeEvent = tuple[str, float]


class RoleWork(Message):
    """New work for a node's role, stamped with the epoch the sender saw (None: any)."""

    epoch: int | None = Field(default=None, ge=0)


@register
class PrefillRequest(RoleWork):
    type: Literal["prefill_request"] = "prefill_request"
    request_id: str = Field(min_length=1, max_length=128)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams
    lease_s: float = Field(gt=0, le=3600)


@register
class PrefillResult(Message):
    type: Literal["prefill_result"] = "prefill_result"
    request_id: str
    first_token_id: int
    finish_reason: FinishReasonName | None  # set if the request ended at its first token
    kv: KVHandle | None  # set iff finish_reason is None
    events: list[NodeEvent] = Field(default_factory=list, max_length=64)  # for the trace
    num_cached_tokens: int = Field(default=0, ge=0)  # prompt tokens the prefix cache saved
    first_logprobs: TokenLogprobs | None = None  # if the request asked for logprobs
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., if asked for


@register
class PrefillAccepted(Message):
    """First line of a streamed prefill: the node took the request; its KV will be held
    under `kv` and is written to the decode node that asks for it, while it computes."""

    type: Literal["prefill_accepted"] = "prefill_accepted"
    request_id: str
    kv: KVHandle


@register
class DecodeRequest(RoleWork):
    type: Literal["decode_request"] = "decode_request"
    request_id: str = Field(min_length=1, max_length=128)
    prompt_token_ids: list[int] = Field(min_length=1)
    # None: streamed KV (the prefill node is still computing); the first token comes from
    # the prefill node with the KV (KVFirstToken) and is checked like this field.
    first_token_id: int | None
    sampling: SamplingParams
    kv: KVHandle


@register
class GenerateRequest(RoleWork):
    type: Literal["generate_request"] = "generate_request"
    request_id: str = Field(min_length=1, max_length=128)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams


@register
class TokenDelta(Message):
    """One line of a node's token stream; the last one has finish_reason or error."""

    type: Literal["token_delta"] = "token_delta"
    request_id: str
    token_ids: list[int]
    finish_reason: FinishReasonName | None = None
    error: str | None = None
    error_code: str | None = None  # e.g. kv_failed, kv_timeout: the proxy may retry elsewhere
    events: list[NodeEvent] = Field(default_factory=list, max_length=64)  # first line only
    num_cached_tokens: int | None = Field(default=None, ge=0)  # first line only
    logprobs: list[TokenLogprobs] | None = None  # one per token id, if asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # first line only, if asked for
    choice: int = Field(default=0, ge=0)  # sampling.n > 1: the choice these tokens are of


@register
class LeaseExtend(Message):
    type: Literal["lease_extend"] = "lease_extend"
    request_ids: list[str] = Field(max_length=4096)
    lease_s: float = Field(gt=0, le=3600)


@register
class LeaseExtendResult(Message):
    type: Literal["lease_extend_result"] = "lease_extend_result"
    extended: list[str]
    missing: list[str]  # unknown, expired or already sent


@register
class CancelResult(Message):
    type: Literal["cancel_result"] = "cancel_result"
    request_id: str
    found: bool
    stage: Stage | None = None  # where the node found it (one of NODE_STAGES)


SwitchableRole = Literal["prefill", "decode"]


@register
class RoleChange(Message):
    """Drain the node's current role and serve `role` at the next epoch. `epoch`: the epoch
    the caller saw (a node at another one answers 409 stale_epoch); `drain_timeout_s`: how
    long the old role's work may run before what is left is ended (None: the node's own)."""

    type: Literal["role_change"] = "role_change"
    role: SwitchableRole
    epoch: int | None = Field(default=None, ge=0)
    drain_timeout_s: float | None = Field(default=None, ge=0, le=3600)


@register
class RoleChangeResult(Message):
    type: Literal["role_change_result"] = "role_change_result"
    previous_role: SwitchableRole
    role: SwitchableRole
    epoch: int = Field(ge=0)
    drained_s: float = Field(ge=0)  # from the start of the drain to serving again
    evicted: int = Field(default=0, ge=0)  # requests the drain timeout ended


@register
class ResetPrefixCache(Message):
    """Forget every cached block no request holds (benchmarks start from a cold cache)."""

    type: Literal["reset_prefix_cache"] = "reset_prefix_cache"


@register
class ResetPrefixCacheResult(Message):
    type: Literal["reset_prefix_cache_result"] = "reset_prefix_cache_result"
    blocks: int = Field(ge=0)  # cached blocks forgotten


MAX_KV_PEERS = 256


@register
class KVPeers(Message):
    """Prefill nodes' KV side channels a decode node will take KV from: it connects to the
    ones it does not know yet in the background, so that the first request from each one
    does not wait for the handshake (the proxy sends them as it finds prefill nodes)."""

    type: Literal["kv_peers"] = "kv_peers"
    side_channels: list[str] = Field(max_length=MAX_KV_PEERS)


@register
class KVPeersResult(Message):
    type: Literal["kv_peers_result"] = "kv_peers_result"
    connecting: int = Field(ge=0)  # handshakes this call started
    known: int = Field(ge=0)  # side channels already connected or connecting


__all__ = [
    "CancelResult",
    "DecodeRequest",
    "GenerateRequest",
    "KVHandle",
    "KVPeers",
    "KVPeersResult",
    "LeaseExtend",
    "LeaseExtendResult",
    "MessageError",
    "PrefillAccepted",
    "PrefillRequest",
    "PrefillResult",
    "ResetPrefixCache",
    "ResetPrefixCacheResult",
    "RoleChange",
    "RoleChangeResult",
    "RoleWork",
    "TokenDelta",
    "from_json",
    "to_json",
]
