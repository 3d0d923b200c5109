"""The interface every transport implements, and the events it reports to the agent.

A backend moves the bytes of whole blocks from the local cache into a peer's
cache and tells the agent when a write completed or failed, and when a peer's
write into our cache landed. It owns no request lifetimes: the agent keeps the
transfer records and their states. All methods are called from the agent's
progress thread only, so implementations need no locks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import zmq

from common.wire.messages import Message, PeerInfo
from kv_transfer.config import TransferConfig
from kv_transfer.layout import CacheLayout
from kv_transfer.state import OutgoingTransfer


@dataclass(frozen=True, slots=True)
class WriteCompleted:
    """An outgoing write landed in the peer's memory; its source is no longer read."""

    request_id: str


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """An outgoing write ended without completing and is locally quiescent."""

    request_id: str
    detail: str
    peer_lost: bool = False  # the failure says the peer is gone (disconnect)


@dataclass(frozen=True, slots=True)
class Landed:
    """A peer's write for request_id finished landing in our cache (the notification)."""

    peer_id: str
    request_id: str
    num_blocks: int = 0  # the blocks of this write; 0: all of the transfer


BackendEvent = WriteCompleted | WriteFailed | Landed

# Sends a message to a connected peer over the side channel; False if it could not.
SendFn = Callable[[str, Message], bool]


class Backend(ABC):
    """One transport. Constructed once per agent with the cache it serves."""

    name: ClassVar[str]
    # post() finishes a small write in the call and touches no socket the progress
    # thread polls, so an owner's thread may call it under the agent's state lock.
    posts_inline: ClassVar[bool] = False
    # A peer's writes land without any action of ours (RDMA): after remove_peer() a live
    # peer may still write into our blocks, so the layer quarantines them (transfers.py).
    one_sided: ClassVar[bool] = False

    def __init__(
        self, agent_name: str, layout: CacheLayout, config: TransferConfig, send: SendFn
    ) -> None:
        self.agent_name = agent_name
        self.layout = layout
        self.config = config
        self.send = send
        # Whether an incoming write (sender, request id, destination blocks) is one this
        # agent expects (TransferBook.accepts, set by the agent): two-sided receivers land
        # bytes only into blocks reserved for that sender's transfer of that request.
        self.accepts: Callable[[str, str, np.ndarray], bool] = lambda *_: True

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this backend (sent in the handshake)."""

    @abstractmethod
    def add_peer(self, info: PeerInfo, send_channel: int, recv_channel: int) -> None:
        """Make `info.agent_name` writable and accept its writes.

        send_channel: the id the peer assigned to our writes into it;
        recv_channel: the id we assigned to its writes into us. Raises TransportError.
        """

    @abstractmethod
    def remove_peer(self, peer_id: str) -> list[BackendEvent]:
        """Forget a peer (lost or closing).

        On return no write of that peer lands in our cache any more (unless one_sided). Returns a
        WriteFailed for each posted outgoing write that is quiescent now; any other
        is reported by a later progress() once it is (completed or failed).
        """

    @abstractmethod
    def post(self, xfer: OutgoingTransfer) -> BackendEvent | None:
        """Start writing xfer.src_ids into the peer's xfer.dst_ids (both int32 arrays).

        The peer's backend reports Landed(xfer.request_id) only after every byte landed.
        Returns an event if the write already ended, else None (reported by progress()).
        Raises TransportError if it could not be started (nothing was written).
        """

    @abstractmethod
    def cancel(self, xfer: OutgoingTransfer) -> bool:
        """Try to stop a posted write. True only if nothing more of it can land (nor be
        read), and progress() reports nothing for it; False: it runs to its end and is
        reported."""

    @abstractmethod
    def progress(self) -> list[BackendEvent]:
        """Advance the transport; return what completed, failed or landed since."""

    @abstractmethod
    def busy(self) -> bool:
        """True while progress() must be called promptly (transfers in flight)."""

    def polls_for_landing(self) -> bool:
        """True if incoming writes are only seen by polling (no fd wakes us for them)."""
        return False

    def register(self, poller: zmq.Poller) -> None:  # noqa: B027 - optional hook
        """Register sockets or fds whose readiness should wake the progress thread."""

    def on_ready(self, ready: dict) -> list[BackendEvent]:
        """Handle the registered sockets that poll() reported readable."""
        return []

    def on_message(self, peer_id: str, msg: Message) -> list[BackendEvent] | None:
        """A side-channel message meant for the backend (BlockWrite, KVDone ack);
        None if it is not one of the backend's."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release every resource; called once, after all peers were removed."""
