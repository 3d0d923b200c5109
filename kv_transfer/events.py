"""Events the layer reports to its owner (the node). The layer never frees blocks.

Every write() and every request_transfer() ends in exactly one terminal
event for its request id:

  sender (write):              TransferDone | TransferFailed | Quiescent (after abort())
  receiver (request_transfer): KVReceived   | TransferFailed | Quiescent (after abort())

(after abort(): unless the transfer had already ended). A terminal event is only
reported once the transfer is quiescent: no byte of it will be read from the
source or written to the destination any more, so the owner may free the blocks
when it sees it. A write nobody asked for still reports KVReceived on landing.

Two events are not terminal: KVProgress (a streamed transfer's write landed, more are to
come), and TransferLost, on the receiver, when the sender was lost while
a one-sided backend (nixl) could still let its write land. The request has failed (the
owner may give up on it at once) but the blocks stay quarantined: the terminal event
follows once the sender answered that no write is in progress, or was replaced by a new
incarnation, or after TransferConfig.quarantine_timeout_s.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from common.wire.messages import Message


class FailureReason(str, Enum):
    PEER_LOST = "peer_lost"  # connection dropped, heartbeat silence, or backend disconnect
    BACKEND_ERROR = "backend_error"
    ABORTED_BY_PEER = "aborted_by_peer"  # the other side asked to stop (Abort / KVAborted)
    CLOSED = "closed"  # the local agent was closed with the transfer unfinished


@dataclass(frozen=True, slots=True)
class TransferDone:
    """Sender: the write landed in the peer's blocks; the source blocks are free to go."""

    request_id: str
    peer_id: str


@dataclass(frozen=True, slots=True)
class TransferFailed:
    """Either side: the transfer ended without landing (all of it); it is quiescent."""

    request_id: str
    peer_id: str
    reason: FailureReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TransferLost:
    """Receiver: the sender was lost mid-transfer; the request failed, but its blocks stay
    held (quarantined) until the terminal event for it."""

    request_id: str
    peer_id: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class KVProgress:
    """Receiver, streamed transfer: one write of it landed (`landed` of `total` blocks are
    in); not terminal: KVReceived follows once all are."""

    request_id: str
    peer_id: str
    landed: int
    total: int


@dataclass(frozen=True, slots=True)
class KVReceived:
    """Receiver: the notification for request_id arrived; its blocks hold the data."""

    request_id: str
    peer_id: str


@dataclass(frozen=True, slots=True)
class Quiescent:
    """After abort(request_id): nothing more moves. landed: whether the write completed."""

    request_id: str
    peer_id: str
    landed: bool


@dataclass(frozen=True, slots=True)
class PeerConnected:
    peer_id: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class PeerLost:
    peer_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """A typed side-channel message for the owner (TransferRequest, Abort, Release, ...)."""

    peer_id: str
    message: Message


TransferEvent = (
    TransferDone
    | TransferFailed
    | TransferLost
    | KVReceived
    | KVProgress
    | Quiescent
    | PeerConnected
    | PeerLost
    | MessageReceived
)

TERMINAL_EVENTS = (TransferDone, TransferFailed, KVReceived, Quiescent)
