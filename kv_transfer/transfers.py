"""The transfer records of one agent, and the events they turn into. Progress thread only.

Writes to a peer are posted to the backend up to `max_inflight` at a time; the
rest wait in a per-peer FIFO where an abort stops them before any byte moves.
Each record ends exactly once, through _end_out / _end_in, which emit its one
terminal event (see events.py) after the transfer is quiescent.

Quarantine (one-sided backends): when the sender of an expected write is lost, that write
may still land, so the record is QUARANTINED instead of failed: the owner hears
TransferLost at once, and the terminal event only when the sender, back again, answers the
Abort this side re-sends (KVAborted: no write in progress; KVDone: it landed), or a new
incarnation of it replaces it, or after quarantine_s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable

import numpy as np

from common.wire.messages import Abort, KVAborted, TransferRequest
from kv_transfer.backends.base import (
    Backend,
    BackendEvent,
    Landed,
    SendFn,
    WriteCompleted,
)
from kv_transfer.errors import TransportError
from kv_transfer.events import (
    FailureReason,
    KVProgress,
    KVReceived,
    Quiescent,
    TransferDone,
    TransferEvent,
    TransferFailed,
    TransferLost,
)
from kv_transfer.shared import Registry
from kv_transfer.state import AbortOrigin, IncomingTransfer, InState, OutgoingTransfer, OutState

log = logging.getLogger(__name__)

_RECENT_INCOMING = 10_000  # finished incoming ids remembered to drop late duplicates


class TransferBook:
    def __init__(
        self,
        backend: Backend,
        send: SendFn,
        emit: Callable[[TransferEvent], None],
        registry: Registry,
        max_inflight: int,
        quarantine_s: float = 60.0,
    ) -> None:
        self.backend = backend
        self.send = send
        self.emit = emit
        self.registry = registry
        self.max_inflight = max_inflight
        self.quarantine_s = quarantine_s
        self.quarantined: dict[str, float] = {}  # incoming request id -> deadline
        self.quarantine_timeouts = 0  # quarantines that ended by time, not by an answer
        self.out: dict[str, OutgoingTransfer] = {}
        self.incoming: dict[str, IncomingTransfer] = {}
        self._queues: defaultdict[str, deque[OutgoingTransfer]] = defaultdict(deque)
        self._inflight: Counter[str] = Counter()
        self._lost: dict[str, float] = {}  # peer lost and not (yet) reconnected -> when
        # Writes posted to a peer when it was lost -> when: the backend may still settle
        # them; expire_stragglers ends those it never settles. Keyed by write, not by peer,
        # so a peer that reconnects starts clean.
        self._orphans: dict[str, float] = {}
        self._recent_in: OrderedDict[str, None] = OrderedDict()
        self._suspects: set[str] = set()  # peers a backend error says are gone

    def expecting(self) -> bool:
        return len(self.incoming) > len(self.quarantined)

    def nothing_queued_for(self, peer_id: str) -> bool:
        return not self._queues.get(peer_id)

    # -- owner commands ----------------------------------------------------------------------

    def submit(self, xfer: OutgoingTransfer, peer_alive: bool) -> None:
        self.out[xfer.request_id] = xfer
        if self.registry.is_tombstoned(
            xfer.request_id, xfer.peer_id
        ):  # the receiver's Abort arrived after write() was called: never start it
            xfer.abort_origin = AbortOrigin.PEER
            self._end_out(xfer, landed=False, detail="aborted by the receiver")
            return
        if not peer_alive:
            self._end_out(xfer, landed=False, reason=FailureReason.PEER_LOST, detail="peer lost")
            return
        self._queues[xfer.peer_id].append(xfer)  # posted by pump(), after the whole batch
        # of commands it came with: an abort in the same batch stops it before it starts

    def more(self, request_id: str, src: np.ndarray, dst: np.ndarray, final: bool) -> None:
        """The next segment of a streamed write: posted once the one before it completed."""
        xfer = self.out.get(request_id)
        if xfer is None or xfer.final or xfer.state is OutState.ABORTING:
            # Ended (its terminal event is on its way to the owner) or being aborted.
            log.debug("segment of %s dropped: its write is ending", request_id)
            return
        if xfer.pending and xfer.pending[-1][2]:
            log.warning("segment of %s after its final one dropped", request_id)
            return
        xfer.pending.append((src, dst, final))
        if xfer.state is OutState.IDLE:
            xfer.next_segment()
            self._queues[xfer.peer_id].append(xfer)

    def _segment_done(self, xfer: OutgoingTransfer) -> None:
        """The posted segment of `xfer` landed: the write is DONE, or its next segment goes
        (queued, or awaited in IDLE); an aborted stream ends here, quiescent."""
        complete = xfer.final and not xfer.pending
        if xfer.state is OutState.ABORTING or complete:
            self._end_out(xfer, landed=complete)
        elif xfer.pending:
            xfer.next_segment()
            self._queues[xfer.peer_id].appendleft(xfer)
        else:
            xfer.transition(OutState.IDLE)

    def pump(self) -> None:
        """Post queued writes, up to max_inflight per peer."""
        for peer_id in [p for p, q in self._queues.items() if q]:
            self._pump(peer_id)

    def accepts(self, peer_id: str, request_id: str, dst: np.ndarray) -> bool:
        """Whether `peer_id` may write `request_id`'s KV into blocks `dst`: only into the
        blocks this agent reserved for that transfer from that peer, while it is expected."""
        inc = self.incoming.get(request_id)
        if inc is None or inc.peer_id != peer_id or not inc.open:
            return False
        return bool(np.isin(dst, inc.dst_ids).all())

    def expect(self, inc: IncomingTransfer, request: TransferRequest) -> None:
        self.incoming[inc.request_id] = inc
        if not self.send(inc.peer_id, request):
            self._end_in(inc, InState.FAILED, FailureReason.PEER_LOST, "peer not connected")

    def abort(self, request_id: str) -> None:
        xfer = self.out.get(request_id)
        if xfer is not None:
            self._abort_out(xfer, AbortOrigin.LOCAL)
            return
        inc = self.incoming.get(request_id)
        if inc is not None:
            inc.aborted_locally = True  # (a quarantined one ends as its quarantine does)
        if inc is not None and inc.state is InState.EXPECTED:
            inc.transition(InState.ABORT_REQUESTED)
            if not self.send(inc.peer_id, Abort(request_id=request_id)):
                self._end_in(inc, InState.FAILED, FailureReason.PEER_LOST, "peer not connected")

    def refuse(self, request_id: str, peer_id: str, detail: str) -> None:
        """End a transfer that never got a record (the agent is closing)."""
        self.registry.finish(request_id)
        self.emit(TransferFailed(request_id, peer_id, FailureReason.CLOSED, detail))

    # -- peer messages -----------------------------------------------------------------------

    def on_peer_abort(self, peer_id: str, request_id: str) -> None:
        """The receiver asked us to stop writing request_id."""
        xfer = self.out.get(request_id)
        if xfer is not None and xfer.peer_id != peer_id:
            log.warning(
                "%s asked to abort %s, which is written to %s", peer_id, request_id, xfer.peer_id
            )
            return
        self.registry.tombstone(request_id, peer_id)
        if xfer is not None:
            self._abort_out(xfer, AbortOrigin.PEER)
        else:  # no write exists, and none may start now: tell the receiver at once
            self.send(peer_id, KVAborted(request_id=request_id, reason="no write in progress"))

    def on_peer_aborted(self, peer_id: str, msg: KVAborted) -> None:
        """The sender says no write for msg.request_id will land."""
        inc = self.incoming.get(msg.request_id)
        if inc is None or inc.peer_id != peer_id:
            log.debug("KVAborted for unknown incoming %s from %s", msg.request_id, peer_id)
            return
        if inc.state is InState.QUARANTINED:
            detail = f"quarantine ended: the sender says {msg.reason!r}"
            self._end_in(inc, InState.ABORTED, FailureReason.PEER_LOST, detail)
            return
        self._end_in(inc, InState.ABORTED, FailureReason.ABORTED_BY_PEER, msg.reason)

    # -- backend events ----------------------------------------------------------------------

    def on_backend(self, events: list[BackendEvent]) -> None:
        for ev in events:
            if isinstance(ev, Landed):
                self._on_landed(ev)
                continue
            xfer = self.out.get(ev.request_id)
            if xfer is None or xfer.state not in (OutState.POSTED, OutState.ABORTING):
                log.warning("backend reported %s for no posted write", ev)
                continue
            self._inflight[xfer.peer_id] -= 1
            if isinstance(ev, WriteCompleted):
                self._segment_done(xfer)
            else:
                if ev.peer_lost and xfer.peer_id not in self._lost:
                    self._suspects.add(xfer.peer_id)
                lost = (
                    ev.peer_lost or xfer.peer_id in self._lost or xfer.request_id in self._orphans
                )
                reason = FailureReason.PEER_LOST if lost else FailureReason.BACKEND_ERROR
                self._end_out(xfer, landed=False, reason=reason, detail=ev.detail)
            self._pump(xfer.peer_id)

    def _on_landed(self, ev: Landed) -> None:
        inc = self.incoming.get(ev.request_id)
        if inc is None:
            if ev.request_id in self._recent_in:
                log.warning("late notification for finished %s dropped", ev.request_id)
            else:  # a write nobody asked for: still the owner's to judge
                self.emit(KVReceived(ev.request_id, ev.peer_id))
            return
        if inc.peer_id != ev.peer_id:
            log.error("%s landed from %s, expected from %s", ev.request_id, ev.peer_id, inc.peer_id)
            return
        total = len(inc.dst_ids)
        inc.landed_blocks += ev.num_blocks or total
        if inc.landed_blocks < total:  # one write of a streamed transfer: more to come
            self.emit(KVProgress(ev.request_id, ev.peer_id, inc.landed_blocks, total))
            return
        self._end_in(inc, InState.LANDED)

    def take_suspects(self) -> set[str]:
        """Peers whose writes failed with a disconnect since the last call."""
        suspects, self._suspects = self._suspects, set()
        return suspects

    # -- peer loss ---------------------------------------------------------------------------

    def fail_peer(self, peer_id: str, reason: str, quarantine_s: float | None = None) -> None:
        """The peer is gone: end everything with it once each piece is quiescent."""
        quarantine_s = self.quarantine_s if quarantine_s is None else quarantine_s
        now = self._lost[peer_id] = time.monotonic()
        for xfer in list(self._queues.pop(peer_id, ())):
            self._end_out(xfer, landed=False, reason=FailureReason.PEER_LOST, detail=reason)
        for xfer in [x for x in self.out.values() if x.peer_id == peer_id]:
            if xfer.state is OutState.IDLE:  # a stream between segments: nothing in flight
                self._end_out(xfer, landed=False, reason=FailureReason.PEER_LOST, detail=reason)
        for xfer in self.out.values():
            if xfer.peer_id == peer_id and xfer.state in (OutState.POSTED, OutState.ABORTING):
                self._orphans.setdefault(xfer.request_id, now)
        self.on_backend(self.backend.remove_peer(peer_id))  # two-sided: nothing lands now
        for inc in [i for i in self.incoming.values() if i.peer_id == peer_id and i.open]:
            if self.backend.one_sided:
                inc.transition(InState.QUARANTINED)
                self.quarantined[inc.request_id] = now + quarantine_s
                self.emit(TransferLost(inc.request_id, peer_id, reason))
            else:
                self._end_in(inc, InState.FAILED, FailureReason.PEER_LOST, reason)

    def peer_connected(self, peer_id: str) -> None:
        """A (re)connected peer: new writes to it are not the lost connection's orphans,
        and it is asked about the writes it was lost in the middle of."""
        self._lost.pop(peer_id, None)
        for rid in self._quarantined_of(peer_id):
            self.send(peer_id, Abort(request_id=rid))  # answered by KVAborted or KVDone

    def peer_replaced(self, peer_id: str) -> None:
        """A new incarnation holds the old one's address: the old process is gone, and
        nothing of it can land any more."""
        for rid in self._quarantined_of(peer_id):
            detail = "quarantine ended: the sender was replaced by a new incarnation"
            self._end_in(self.incoming[rid], InState.FAILED, FailureReason.PEER_LOST, detail)

    def quarantined_peers(self) -> set[str]:
        """The lost senders of the writes in quarantine."""
        return {self.incoming[r].peer_id for r in self.quarantined}

    def _quarantined_of(self, peer_id: str) -> list[str]:
        return [r for r in self.quarantined if self.incoming[r].peer_id == peer_id]

    def expire_stragglers(self, grace_s: float) -> None:
        """Writes posted to a lost peer that the backend never settled: fail them after
        grace_s. Only the source side can be left reading; a dead peer cannot write to us.
        Writes queued or posted after the peer came back are not touched. Quarantines past
        their deadline end here too."""
        now = time.monotonic()
        for rid, deadline in list(self.quarantined.items()):
            if now > deadline:
                log.warning("%s: quarantine timed out; its blocks are released", rid)
                self.quarantine_timeouts += 1
                detail = "quarantine timed out"
                self._end_in(self.incoming[rid], InState.FAILED, FailureReason.PEER_LOST, detail)
        if not self._orphans:
            return
        for rid, lost_at in list(self._orphans.items()):
            xfer = self.out.get(rid)
            if xfer is None or xfer.state not in (OutState.POSTED, OutState.ABORTING):
                del self._orphans[rid]
            elif now - lost_at > grace_s:
                log.warning("%s: backend did not settle after peer loss", rid)
                self._inflight[xfer.peer_id] -= 1
                detail = "peer lost (unsettled)"
                self._end_out(xfer, False, FailureReason.PEER_LOST, detail, settled=False)

    def close(self) -> None:
        for peer_id in {x.peer_id for x in self.out.values()} | {
            i.peer_id for i in self.incoming.values()
        }:
            self.fail_peer(peer_id, "agent closed")
        for xfer in list(self.out.values()):
            self._end_out(xfer, False, FailureReason.CLOSED, "agent closed")
        for inc in list(self.incoming.values()):  # quarantined: the cache goes with the agent
            self._end_in(inc, InState.FAILED, FailureReason.CLOSED, "agent closed")

    # -- internals ---------------------------------------------------------------------------

    def _pump(self, peer_id: str) -> None:
        queue = self._queues.get(peer_id)
        while queue and self._inflight[peer_id] < self.max_inflight:
            xfer = queue.popleft()
            xfer.transition(OutState.POSTED)
            self._inflight[peer_id] += 1
            try:
                ev = self.backend.post(xfer)
            except TransportError as e:
                self._inflight[peer_id] -= 1
                self._end_out(xfer, False, FailureReason.BACKEND_ERROR, str(e))
                continue
            if ev is not None:
                self.on_backend([ev])

    def _abort_out(self, xfer: OutgoingTransfer, origin: AbortOrigin) -> None:
        if origin is AbortOrigin.LOCAL or xfer.abort_origin is AbortOrigin.NONE:
            xfer.abort_origin = origin
        self.registry.tombstone(xfer.request_id, xfer.peer_id)
        if xfer.state is OutState.QUEUED:
            self._queues[xfer.peer_id].remove(xfer)
            self._end_out(xfer, landed=False)
        elif xfer.state is OutState.IDLE:  # a stream between segments: nothing in flight
            self._end_out(xfer, landed=False)
        elif xfer.state is OutState.POSTED:
            xfer.transition(OutState.ABORTING)
            if self.backend.cancel(xfer):
                self._inflight[xfer.peer_id] -= 1
                self._end_out(xfer, landed=False)
                self._pump(xfer.peer_id)

    def _end_out(
        self,
        xfer: OutgoingTransfer,
        landed: bool,
        reason: FailureReason = FailureReason.BACKEND_ERROR,
        detail: str = "",
        settled: bool = True,
    ) -> None:
        """End a write; `settled`: the backend can touch it no more (False only for a
        straggler given up on, whose bytes might still land: then the receiver is never
        told "aborted", and keeps its blocks quarantined until its own deadline)."""
        rid, peer = xfer.request_id, xfer.peer_id
        aborted = xfer.abort_origin is not AbortOrigin.NONE
        if landed:
            xfer.transition(OutState.DONE)
        elif aborted and reason is not FailureReason.PEER_LOST:
            xfer.transition(OutState.ABORTED)
        else:
            xfer.transition(OutState.FAILED)
        self._orphans.pop(rid, None)
        # A peer lost and not back cannot be told; one back again (it may be waiting on a
        # quarantine of these blocks) is, once the write is settled.
        if not landed and peer not in self._lost and settled:
            self.send(peer, KVAborted(request_id=rid, reason=detail or "aborted"))
        del self.out[rid]
        self.registry.finish(rid)
        if xfer.abort_origin is AbortOrigin.LOCAL:
            self.emit(Quiescent(rid, peer, landed))
        elif landed:
            self.emit(TransferDone(rid, peer))
        else:
            by_peer = aborted and reason is not FailureReason.PEER_LOST
            self.emit(
                TransferFailed(
                    rid, peer, FailureReason.ABORTED_BY_PEER if by_peer else reason, detail
                )
            )

    def _end_in(
        self,
        inc: IncomingTransfer,
        new: InState,
        reason: FailureReason = FailureReason.PEER_LOST,
        detail: str = "",
    ) -> None:
        abort_requested = inc.aborted_locally
        inc.transition(new)
        del self.incoming[inc.request_id]
        self.quarantined.pop(inc.request_id, None)
        self.registry.finish(inc.request_id)
        self._recent_in[inc.request_id] = None
        if len(self._recent_in) > _RECENT_INCOMING:
            self._recent_in.popitem(last=False)
        landed = new is InState.LANDED
        if abort_requested:
            self.emit(Quiescent(inc.request_id, inc.peer_id, landed))
        elif landed:
            self.emit(KVReceived(inc.request_id, inc.peer_id))
        else:
            self.emit(TransferFailed(inc.request_id, inc.peer_id, reason, detail))
