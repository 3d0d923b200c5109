"""NIXL (UCX) backend: one-sided WRITEs of whole blocks with a completion notification.

Set-up cost is paid once: the whole cache is registered at start, the local
descriptor list (one descriptor per block) is prepared once, and one remote
list per peer at handshake. A write is then a single make_prepped_xfer() with
two int32 index arrays: no Python loop over blocks or layers, and NIXL merges
runs of adjacent blocks into larger descriptors on its own.

NIXL's own progress thread is off by default: on a 2-core host it competed with
both processes' pollers and cut 16 MiB bandwidth to a third. Progress happens
in the agent's progress thread instead (check_xfer_state / get_new_notifs).

The receiver learns that a write landed from a KVDone. By default
(config.nixl_notify == "side_channel") the sender sends it over the side
channel once the transfer is DONE: NIXL flushes the endpoint before it reports
DONE, so the bytes are in place, and the receiver is woken by its socket
instead of polling NIXL. With "nixl" the KVDone rides on the transfer as a NIXL
notification; here that made each small write wait 1-12 ms for the receiver's
UCX progress (README, "Defaults"). Receivers accept both.

An abort never releases a write in progress: releasing an active handle cancels its UCX
requests, but bytes already posted may still land after the receiver was told "aborted"
and reused the blocks. An aborted write runs to its end (a few ms for a request's KV).
Only a lost peer's writes are released (remove_peer); the peer, if it is alive after all,
quarantines the blocks they were going to (one_sided).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.wire.messages import KVDone, Message, MessageError, PeerInfo, decode, encode
from kv_transfer.backends.base import (
    Backend,
    BackendEvent,
    Landed,
    SendFn,
    WriteCompleted,
    WriteFailed,
)
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransportError
from kv_transfer.layout import CacheLayout
from kv_transfer.state import OutgoingTransfer

if TYPE_CHECKING:  # nixl ships no type information: to mypy these names are Any
    from nixl._api import nixl_prepped_dlist_handle, nixl_xfer_handle

log = logging.getLogger(__name__)

# After posting, poll this long for completion before handing the write to progress():
# here the data moves inside transfer() and only NIXL's endpoint flush is left, which
# takes tens of microseconds, so a small write usually completes within post().
_SETTLE_S = 0.0003


def _nixl_errors() -> tuple[type[BaseException], ...]:
    import nixl._bindings as b

    names = [n for n in dir(b) if n.startswith("nixl") and n.endswith("Error")]
    return (RuntimeError, ValueError, *(getattr(b, n) for n in names))


@dataclass
class _NixlPeer:
    name: str
    dlist: nixl_prepped_dlist_handle  # over the peer's blocks
    dead: bool = False


class NixlBackend(Backend):
    name = "nixl"
    posts_inline = True
    one_sided = True

    def __init__(
        self, agent_name: str, layout: CacheLayout, config: TransferConfig, send: SendFn
    ) -> None:
        super().__init__(agent_name, layout, config, send)
        from nixl._api import nixl_agent, nixl_agent_config

        self._errors = _nixl_errors()
        conf = nixl_agent_config(enable_prog_thread=config.nixl_progress_thread, backends=["UCX"])
        self._agent = nixl_agent(agent_name, conf)
        if "UCX" not in self._agent.backends:
            raise TransportError("nixl: the UCX backend plugin is not available")
        # A CUDA tensor registers as VRAM on its GPU, a host one as DRAM.
        self._reg = self._agent.register_memory(layout.tensor)
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", layout.block_addrs(), layout.memory
        )
        self._peers: dict[str, _NixlPeer] = {}
        self._posted: dict[str, OutgoingTransfer] = {}
        self._notify_inline = config.nixl_notify == "nixl"
        self._next_notif_poll = 0.0

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, info: PeerInfo, send_channel: int, recv_channel: int) -> None:
        try:
            name = _text(self._agent.add_remote_agent(info.backend_metadata))
            if name != info.agent_name:
                raise TransportError(f"nixl metadata names {name!r}, peer is {info.agent_name!r}")
            rows = self.layout.block_addrs(info.region)
            dlist = self._agent.prep_xfer_dlist(name, rows, info.region.memory)
            self._agent.make_connection(name)
        except self._errors as e:
            raise TransportError(f"nixl: cannot add peer {info.agent_name}: {e}") from e
        self._peers[name] = _NixlPeer(name, dlist)

    def remove_peer(self, peer_id: str) -> list[BackendEvent]:
        peer = self._peers.get(peer_id)
        if peer is None:
            return []
        peer.dead = True
        events: list[BackendEvent] = []
        for xfer in [x for x in self._posted.values() if x.peer_id == peer_id]:
            if self._drop(xfer):
                events.append(WriteFailed(xfer.request_id, "peer lost", peer_lost=True))
        self._forget_dead()
        return events

    def post(self, xfer: OutgoingTransfer) -> BackendEvent | None:
        peer = self._peers.get(xfer.peer_id)
        if peer is None or peer.dead:
            raise TransportError(f"nixl: peer {xfer.peer_id} is not connected")
        notif = b""
        if self._notify_inline:
            notif = encode(KVDone(request_id=xfer.request_id, num_blocks=len(xfer.src_ids)))
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", self._local, xfer.src_ids, peer.dlist, xfer.dst_ids, notif
            )
        except self._errors as e:
            raise TransportError(f"nixl: cannot prepare write {xfer.request_id}: {e}") from e
        try:
            state = self._agent.transfer(handle)
            until = time.perf_counter() + _SETTLE_S
            while state == "PROC" and time.perf_counter() < until:
                state = self._agent.check_xfer_state(handle)  # the endpoint flush, usually
        except self._errors as e:
            self._release(handle)
            return WriteFailed(xfer.request_id, f"nixl post: {e}", peer_lost=_is_disconnect(e))
        xfer.handle = handle
        if state == "PROC":  # still in progress: progress() settles it
            self._posted[xfer.request_id] = xfer
            return None
        return self._settle(xfer, state)

    def cancel(self, xfer: OutgoingTransfer) -> bool:
        return False  # see the module notes: an aborted write runs to its end

    def _drop(self, xfer: OutgoingTransfer) -> bool:
        """Release a write to a lost peer while it is in progress (True), or leave it to
        progress() if it already ended (False)."""
        if xfer.request_id not in self._posted:
            return False
        try:
            if self._agent.check_xfer_state(xfer.handle) != "PROC":
                return False  # finished or failed: progress() reports it
            self._agent.release_xfer_handle(xfer.handle)  # cancels an active transfer
        except self._errors as e:
            log.debug("nixl: %s not cancellable now (%s); waiting for it", xfer.request_id, e)
            return False
        del self._posted[xfer.request_id]
        xfer.handle = None
        return True

    def progress(self) -> list[BackendEvent]:
        events: list[BackendEvent] = []
        for xfer in list(self._posted.values()):
            try:
                state = self._agent.check_xfer_state(xfer.handle)
            except self._errors as e:
                state = f"ERR {e}"
            if state != "PROC":
                del self._posted[xfer.request_id]
                events.append(self._settle(xfer, state))
        now = time.monotonic()
        if self._notify_inline or now >= self._next_notif_poll:
            self._next_notif_poll = now + self.config.idle_poll_interval_s
            events.extend(self._notifications())
        self._forget_dead()
        return events

    def busy(self) -> bool:
        return bool(self._posted)

    def polls_for_landing(self) -> bool:
        return self._notify_inline

    def on_message(self, peer_id: str, msg: Message) -> list[BackendEvent] | None:
        if not isinstance(msg, KVDone):
            return None
        peer = self._peers.get(peer_id)
        if peer is None or peer.dead:
            return []
        return [Landed(peer_id, msg.request_id, msg.num_blocks)]

    def close(self) -> None:
        for xfer in list(self._posted.values()):
            self._drop(xfer)
        for name in list(self._peers):
            self._peers[name].dead = True
        self._forget_dead()
        try:
            self._local.release()
            self._agent.deregister_memory(self._reg)
        except self._errors as e:
            log.warning("nixl: cleanup failed: %s", e)
        self._agent = None  # destroy the NIXL agent (and its UCX workers) now

    # -- internals ---------------------------------------------------------------------------

    def _settle(self, xfer: OutgoingTransfer, state: str) -> BackendEvent:
        """Turn the state of a transfer no longer in progress (DONE, or failed) into its event."""
        self._release(xfer.handle)
        xfer.handle = None
        if state == "DONE":
            if not self._notify_inline:  # DONE follows NIXL's endpoint flush: data is in place
                # (validated: with pydantic 2 that is cheaper than model_construct)
                done = KVDone(request_id=xfer.request_id, num_blocks=xfer.src_ids.size)
                self.send(xfer.peer_id, done)
            return WriteCompleted(xfer.request_id)
        # The peer is lost if it was removed, or if the state says it disconnected (the write
        # can fail with NIXL_ERR_REMOTE_DISCONNECT before the connection layer notices).
        dead = self._peers.get(xfer.peer_id)
        lost = dead is None or dead.dead or _names_disconnect(state)
        return WriteFailed(xfer.request_id, f"nixl transfer {state}", lost)

    def _notifications(self) -> list[BackendEvent]:
        try:
            notifs = self._agent.get_new_notifs()
        except self._errors as e:
            log.warning("nixl: get_new_notifs failed: %s", e)
            return []
        events: list[BackendEvent] = []
        for raw_sender, payloads in notifs.items():
            sender = _text(raw_sender)
            peer = self._peers.get(sender)
            if peer is None or peer.dead:
                log.warning("nixl: dropped %d notification(s) from %s", len(payloads), sender)
                continue
            for payload in payloads:
                try:
                    msg = decode(payload)
                except MessageError as e:
                    log.warning("nixl: bad notification from %s: %s", sender, e)
                    continue
                if isinstance(msg, KVDone):
                    events.append(Landed(sender, msg.request_id, msg.num_blocks))
        return events

    def _release(self, handle: nixl_xfer_handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except self._errors as e:
            log.warning("nixl: release_xfer_handle failed: %s", e)

    def _forget_dead(self) -> None:
        """Drop dead peers once none of their writes is still posted."""
        busy = {x.peer_id for x in self._posted.values()}
        for name in [n for n, p in self._peers.items() if p.dead and n not in busy]:
            peer = self._peers.pop(name)
            try:
                peer.dlist.release()
                self._agent.remove_remote_agent(name)
            except self._errors as e:
                log.debug("nixl: removing %s: %s", name, e)


def _is_disconnect(e: BaseException) -> bool:
    return _names_disconnect(str(e)) or type(e).__name__ == "nixlRemoteDisconnectError"


def _names_disconnect(text: str) -> bool:
    return "DISCONNECT" in text.upper()


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
