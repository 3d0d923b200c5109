"""What the owner's threads and the progress thread share: wakeups, the event queue, the registry.

Everything else belongs to the progress thread alone.
"""

from __future__ import annotations

import ctypes
import os
import select
from collections import OrderedDict, deque

from common.wire.messages import KVRegion
from kv_transfer.events import TransferEvent

# write(2) through PyDLL keeps the GIL: the thread we wake then runs once we block,
# instead of taking the GIL from under us in the middle of the call (two context
# switches per hand-off instead of four or more, measured on a busy 2-core host).
_libc = ctypes.PyDLL(None, use_errno=True)
_ONE = ctypes.c_uint64(1)


class Wakeup:
    """An eventfd: readable after set(), until clear(). Safe from any thread."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        # Fails only with EAGAIN (counter saturated: already readable) or after close().
        _libc.write(self.fd, ctypes.byref(_ONE), 8)

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def wait(self, timeout: float | None) -> bool:
        readable, _, _ = select.select([self.fd], [], [], timeout)
        return bool(readable)

    def close(self) -> None:
        os.close(self.fd)


class EventQueue:
    """Progress thread -> owner. The fd is readable whenever events may be pending.

    Producers put() events under the agent's state lock and publish() once they released
    it: an owner woken by the fd then finds the lock free, so its next write can be posted
    inline instead of queueing behind the rest of the progress thread's step (which made
    every later write of a busy sender take the slow path too).

    The fd is signalled once per batch, not per event: publish() writes it only when it is
    not signalled already, and drain() leaves it signalled while it finds events, and
    clears it only when it finds none. An owner that drains after each event (a busy
    sender) thus makes no eventfd syscall per write, and a wakeup is never lost: events are
    appended before publish() looks at the flag, and _settle() clears the flag before the
    fd and re-signals if an event (or a publish) slipped in meanwhile. At worst a wakeup is
    spurious.
    """

    def __init__(self) -> None:
        self._items: deque[TransferEvent] = deque()
        self._wake = Wakeup()
        self._signalled = False  # the fd was written since it was last cleared
        self._closed = False

    @property
    def fd(self) -> int:
        return self._wake.fd

    def put(self, event: TransferEvent) -> None:
        """Queue an event; the fd says so only after publish()."""
        self._items.append(event)

    def publish(self) -> None:
        """Make the fd readable if events are pending (after the producer's lock is free)."""
        if self._items and not self._signalled and not self._closed:
            self._signalled = True
            self._wake.set()

    def drain(self) -> list[TransferEvent]:
        out = []
        while self._items:
            out.append(self._items.popleft())
        if not out:
            self._settle()
        return out

    def wait(self, timeout: float | None) -> bool:
        if self._items or self._closed:
            return bool(self._items)
        self._settle()
        return self._wake.wait(timeout)

    def _settle(self) -> None:
        """Owner, having found nothing pending: make the fd unreadable again."""
        if self._closed or not self._signalled:
            return
        self._signalled = False
        self._wake.clear()
        if self._items or self._signalled:  # a put() raced in and may have skipped its write
            self._signalled = True
            self._wake.set()

    def close(self) -> None:
        """After the producer stopped: events already queued stay readable."""
        self._closed = True
        self._wake.close()


class Registry:
    """The facts the owner's calls are validated against, kept by the progress thread.

    peers: connected peer id -> its cache region; addresses: side channel -> peer id;
    active: request ids with a live transfer record; tombstones: (request id, peer) pairs
    that were aborted, for which no transfer may start any more (bounded, oldest dropped).
    Per peer, so that one peer's Abort can never stop a transfer to another.

    No lock: the owner (one thread, the node's event loop) must never wait on the progress
    thread. `peers` and `addresses` are replaced whole by the progress thread (copy on
    write), so a reader sees one version or the next. `active` is added to only by the
    owner (`claim`) and discarded from only by the progress thread; tombstones are added
    only by the progress thread. Each of those is one set or dict operation, atomic under
    the GIL, and the owner's check-then-add cannot race another adder.
    """

    def __init__(self, max_tombstones: int = 100_000) -> None:
        self.peers: dict[str, KVRegion] = {}
        self.addresses: dict[str, str] = {}
        self.active: set[str] = set()
        self._tombstones: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._max_tombstones = max_tombstones

    def add_peer(self, peer_id: str, region: KVRegion, address: str) -> None:
        """Progress thread. The peer first, so an address always names a known peer."""
        self.peers = {**self.peers, peer_id: region}
        self.addresses = {**self.addresses, address: peer_id}

    def remove_peer(self, peer_id: str) -> None:
        """Progress thread. Its addresses first, for the same reason."""
        self.addresses = {a: p for a, p in self.addresses.items() if p != peer_id}
        self.peers = {p: r for p, r in self.peers.items() if p != peer_id}

    def tombstone(self, request_id: str, peer_id: str) -> None:
        """Progress thread."""
        key = (request_id, peer_id)
        self._tombstones[key] = None
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    def is_tombstoned(self, request_id: str, peer_id: str) -> bool:
        return (request_id, peer_id) in self._tombstones

    def claim(self, request_id: str, peer_id: str) -> str | None:
        """Owner: mark `request_id` as having a live transfer, or say why it cannot."""
        if request_id in self.active:
            return f"request {request_id!r} already has a live transfer"
        if (request_id, peer_id) in self._tombstones:
            return f"request {request_id!r} was aborted"
        self.active.add(request_id)
        return None

    def finish(self, request_id: str) -> None:
        """Progress thread: the transfer of `request_id` has ended."""
        self.active.discard(request_id)
