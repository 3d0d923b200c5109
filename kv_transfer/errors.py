"""Exceptions the KV-transfer layer raises to its owner."""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base of the layer's errors."""


class HandshakeError(TransferError):
    """connect() failed: refused by the peer (reason in the message), or timed out."""


class TransferRejected(TransferError, ValueError):
    """A write/abort/send the layer refuses at once: bad block ids, unknown peer, duplicate id."""


class TransportError(TransferError):
    """The transport library reported an error (wrapped with the backend's name)."""


class AgentClosed(TransferError):
    """The agent was closed (or its progress thread died); no further calls are served."""
