"""KV-transfer layer: moves paged KV blocks prefill -> decode and reports what happened.

It never frees blocks: the owner (the node) frees through its allocator when a
terminal event says the transfer is quiescent. See agent.py for the threading
model and events.py for the event contract; README.md in this directory holds
the measured defaults.
"""

from kv_transfer.agent import KVTransferAgent
from kv_transfer.config import BACKENDS, TransferConfig
from kv_transfer.errors import (
    AgentClosed,
    HandshakeError,
    TransferError,
    TransferRejected,
    TransportError,
)
from kv_transfer.events import (
    FailureReason,
    KVProgress,
    KVReceived,
    MessageReceived,
    PeerConnected,
    PeerLost,
    Quiescent,
    TransferDone,
    TransferEvent,
    TransferFailed,
    TransferLost,
)

__all__ = [
    "BACKENDS",
    "AgentClosed",
    "TransportError",
    "FailureReason",
    "HandshakeError",
    "KVProgress",
    "KVReceived",
    "KVTransferAgent",
    "MessageReceived",
    "PeerConnected",
    "PeerLost",
    "Quiescent",
    "TransferConfig",
    "TransferDone",
    "TransferError",
    "TransferEvent",
    "TransferFailed",
    "TransferLost",
    "TransferRejected",
]
