"""One node as the proxy sees it: role, status (an enum with legal transitions), the last
`GET /state` (parsed into `NodeState`), and the load this proxy added since that poll."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, field_validator

from common.wire.fsm import Transitions
from proxy.pool.sent import SentLoad


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # colocated: prefills and decodes locally


class NodeStatus(Enum):
    PENDING = "pending"  # registered from flags, not reached yet
    UP = "up"  # answered the last poll, healthy, compatible
    DOWN = "down"  # unreachable, or /health said 503 (draining, engine dead)
    REFUSED = "refused"  # wrong role or model fingerprint: never routed to
    DRAINING = "draining"  # changing role: no new work; what it has finishes or moves


_ANY = {NodeStatus.UP, NodeStatus.DOWN, NodeStatus.REFUSED, NodeStatus.DRAINING}
MOVES: Transitions[NodeStatus] = Transitions(
    "node",
    {
        NodeStatus.PENDING: _ANY,
        NodeStatus.UP: _ANY - {NodeStatus.UP},
        NodeStatus.DOWN: _ANY - {NodeStatus.DOWN},
        NodeStatus.REFUSED: _ANY - {NodeStatus.REFUSED},
        NodeStatus.DRAINING: _ANY - {NodeStatus.DRAINING},
    },
)
SWITCHABLE_ROLES = frozenset({Role.PREFILL, Role.DECODE})  # a `both` node keeps its role


class Capacity(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    max_num_seqs: int = 0  # 0: unknown
    running: int = 0
    reserved: int = 0
    free_blocks: int = 0
    block_size: int = 16


class PrefixCacheInfo(BaseModel):
    """What a router needs to look a prompt up in a node's prefix cache."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    enabled: bool = True
    block_size: int = 16
    salt: str = ""
    kv_events: str | None = None  # the node's KV-event PUB endpoint


class KVTransferInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    side_channel: str = ""  # where decode nodes connect to take the node's KV


class NodeState(BaseModel):
    """The fields of a node's `GET /state` that routing reads (the rest is kept raw)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: str
    engine_id: str = ""
    model_fingerprint: str
    blocks: dict[str, int] = {}
    requests: dict[str, int] = {}
    capacity: Capacity | None = None
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float | None = None  # measured by the node
    step_time_max_s: float | None = None  # its slowest recent engine step
    prefix_cache: PrefixCacheInfo | None = None
    epoch: int = 0  # role changes so far; work sent to the node carries it
    role_state: str = "serving"  # serving | draining | switching | stopping
    switchable: bool = False  # it can change between prefill and decode
    kv_transfer: KVTransferInfo | None = None  # prefill and decode nodes

    @field_validator("model_fingerprint", mode="before")
    @classmethod
    def _canonical(cls, value: Any) -> Any:
        if isinstance(value, dict):  # a structured fingerprint: compare its canonical JSON
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        return value

    @classmethod
    def parse(cls, data: dict[str, Any]) -> NodeState:
        """Raises ValueError (pydantic's ValidationError) naming what is missing."""
        return cls.model_validate(data)

    def free_blocks(self) -> int:
        if self.capacity is not None:
            return self.capacity.free_blocks
        return int(self.blocks.get("free", 0))


def normalize_url(url: str) -> str:
    """`http(s)://host:port[/prefix]` without a trailing slash; ValueError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"node URL must look like http://HOST:PORT, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"node URL must not have a query or fragment: {url!r}")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


@dataclass(eq=False)
class Node:
    url: str
    role: Role
    status: NodeStatus = NodeStatus.PENDING
    error: str | None = None  # why it is DOWN or REFUSED
    state: NodeState | None = None  # the last /state read
    last_ok: float | None = None  # monotonic time of that read
    inflight: int = 0  # this proxy's requests in a call to the node now
    # What this proxy sent that the last /state cannot show yet (sent.py).
    load: SentLoad = field(default_factory=SentLoad)
    # The role this proxy is moving the node to (POST /admin/nodes/role, the planner): it
    # stays DRAINING, with no new work, until the move ends.
    moving_to: Role | None = None
    # A decode node: the prefill nodes' KV side channels it was told to connect to
    # (registry.py), at this incarnation and epoch.
    kv_peers_told: set[str] = field(default_factory=set)
    kv_peers_key: tuple[str, int] | None = None

    @property
    def healthy(self) -> bool:
        return self.status is NodeStatus.UP

    @property
    def epoch(self) -> int | None:
        """The node's epoch at the last poll (None: never read), stamped on work sent to it."""
        return self.state.epoch if self.state is not None else None

    @property
    def fingerprint(self) -> str | None:
        return self.state.model_fingerprint if self.state is not None else None

    def silent(self, now: float, after_s: float) -> bool:
        """No good poll for `after_s` (a node never heard from is not silent: it is PENDING)."""
        return self.last_ok is not None and now - self.last_ok > after_s

    def transition(self, status: NodeStatus, error: str | None) -> None:
        if status is not self.status:  # staying put is allowed: a repeated poll result
            MOVES.move(self.url, self.status, status)
        self.status, self.error = status, error

    # -- load accounting ---------------------------------------------------------------------

    def sent(self, prefill_tokens: int, kv_tokens: int = 0) -> int:
        """Count a request sent to the node until a poll's state shows it: `prefill_tokens`
        of prompt it must compute (until then, or until `computed`), and for a decode the
        `kv_tokens` of KV it keeps. Its ticket."""
        return self.load.send(prefill_tokens, kv_tokens)

    def computed(self, ticket: int) -> None:
        """The node computed the prompt of send `ticket` (its first token came, or the call
        ended without it): no longer queued there, whenever the next poll comes."""
        self.load.computed(ticket)

    @property
    def sent_tokens(self) -> int:
        return self.load.tokens

    @property
    def sent_requests(self) -> int:
        return self.load.requests

    def observe(self, state: NodeState, now: float) -> None:
        self.state, self.last_ok = state, now

    def prefill_load(self) -> int:
        """Queued prefill tokens: as last seen, less computed since, plus sent since."""
        queued = self.state.queued_prefill_tokens if self.state is not None else 0
        return self.load.queued(queued)

    def decode_room(self) -> tuple[bool, int]:
        """(has a free sequence slot, estimated free blocks): larger is roomier."""
        if self.state is None:
            return True, 0
        cap = self.state.capacity
        block_size = cap.block_size if cap is not None and cap.block_size > 0 else 16
        free = self.state.free_blocks() - -(-self.load.kv_tokens // block_size)
        if cap is None or cap.max_num_seqs <= 0:
            return True, free
        return cap.max_num_seqs - self.decode_streams() > 0, free

    def decode_streams(self) -> int:
        """The sequences the node decodes, or will once their KV lands (running and
        reserved as last seen, plus what was sent since): the streams a local prefill
        there holds up for one step."""
        cap = self.state.capacity if self.state is not None else None
        seen = cap.running + cap.reserved if cap is not None else 0
        return seen + self.sent_requests

    def decode_spare(self) -> tuple[int, int, int] | None:
        """(free sequence slots, free blocks, block size) as last seen less what was sent
        since; None while the node has not reported its capacity."""
        cap = self.state.capacity if self.state is not None else None
        if cap is None or cap.max_num_seqs <= 0 or cap.block_size <= 0:
            return None
        _, free = self.decode_room()
        return cap.max_num_seqs - self.decode_streams(), free, cap.block_size

    def describe(self) -> dict[str, Any]:
        """The node's row in `GET /admin/nodes`."""
        state = self.state
        return {
            "url": self.url,
            "role": self.role.value,
            "healthy": self.healthy,
            "status": self.status.value,
            "error": self.error,
            "model_fingerprint": self.fingerprint,
            "engine_id": state.engine_id if state is not None else None,
            "epoch": self.epoch,
            "role_state": state.role_state if state is not None else None,
            "moving_to": self.moving_to.value if self.moving_to is not None else None,
            "seconds_since_seen": (
                round(time.monotonic() - self.last_ok, 3) if self.last_ok is not None else None
            ),
            "blocks": dict(state.blocks) if state is not None else None,
            "requests": dict(state.requests) if state is not None else None,
            "queued_prefill_tokens": state.queued_prefill_tokens if state is not None else None,
            "inflight": self.inflight,
        }
