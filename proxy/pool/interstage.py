"""The inter-stage queue: prefilled requests waiting for decode capacity (DESIGN.md §1.3).

A FIFO, bounded by the edge: only requests that the pre-decode budget admitted get here
(`proxy.pool.budget`), so a prefilled request always finds room. Dispatcher tasks offer
entries in FIFO order to the decode nodes, most free capacity first (`POST /internal/decode`):
the head alone, or several at once while the nodes' last reported capacity holds them all (a
decode node answers an offer only at its engine's next step boundary, when it has reserved
the blocks, so one at a time a burst of N entries waited N decode steps). When every node
answers 503 "decode_full", the head stays at the head and waits for a capacity signal
(`notify_capacity()`: a decode stream ended, a node came up) or a short backoff; nothing
behind it is offered meanwhile. The waiter (`wait(entry)`) gets the accepted stream.

While entries wait, a housekeeping task extends their prefill leases (one `LeaseExtend` per
prefill node, each entry about every lease/3), fails entries whose lease is gone or whose wait
exceeded `max_wait_s`, and cancels them on their prefill node.

Entry states (one `transition()`; terminal: TAKEN, CANCELLED, FAILED):

    QUEUED <-> OFFERING -> DISPATCHED -> TAKEN     (the waiter owns the decode stream)
    QUEUED | OFFERING | DISPATCHED -> CANCELLED    (Cancel to the nodes holding it)
    QUEUED | OFFERING -> FAILED                     (lease lost, no capacity in time, refused)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from enum import Enum

from common.wire.fsm import Transitions
from common.wire.node_messages import DecodeRequest, LeaseExtend
from proxy.http.backend import BackendError, NodeLost
from proxy.metrics import InterStageMetrics
from proxy.pool.client import DECODE_PATH, DecodeFull, NodeClient, NodeStream, NodeUnreachable
from proxy.pool.node_state import Node, Role
from proxy.pool.registry import NodeRegistry

log = logging.getLogger(__name__)

MAX_IDS_PER_EXTEND = 4096  # LeaseExtend.request_ids bound


class EntryState(Enum):
    QUEUED = "queued"
    OFFERING = "offering"  # the dispatcher is offering it to decode nodes now
    DISPATCHED = "dispatched"  # a decode node accepted it; the stream awaits its waiter
    TAKEN = "taken"
    CANCELLED = "cancelled"
    FAILED = "failed"


MOVES: Transitions[EntryState] = Transitions(
    "inter-stage entry",
    {
        EntryState.QUEUED: {EntryState.OFFERING, EntryState.CANCELLED, EntryState.FAILED},
        EntryState.OFFERING: {
            EntryState.QUEUED,
            EntryState.DISPATCHED,
            EntryState.CANCELLED,
            EntryState.FAILED,
        },
        EntryState.DISPATCHED: {EntryState.TAKEN, EntryState.CANCELLED},
        EntryState.TAKEN: set(),
        EntryState.CANCELLED: set(),
        EntryState.FAILED: set(),
    },
)


@dataclass(eq=False)
class QueueEntry:
    """One prefilled request in the queue; `future` resolves to its accepted decode stream."""

    request: DecodeRequest
    prefill_url: str  # the node holding its KV under a lease
    enqueued_at: float  # monotonic
    future: asyncio.Future[NodeStream]
    state: EntryState = EntryState.QUEUED
    stream: NodeStream | None = None  # while DISPATCHED
    extended_at: float = field(init=False)  # when its lease was last (re)started

    def __post_init__(self) -> None:
        self.extended_at = self.enqueued_at

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def transition(self, new: EntryState) -> None:
        self.state = MOVES.move(self.request_id, self.state, new)


@dataclass(frozen=True)
class InterStageConfig:
    lease_s: float = 30.0  # the prefill lease asked for, and each extension
    max_wait_s: float = 300.0  # an entry waiting longer fails (503)
    backoff_min_s: float = 0.01  # wait after an all-full round, doubled up to backoff_max_s
    backoff_max_s: float = 0.25
    retry_after_s: float = 1.0
    # Offers in flight at most. Each waits for the decode node's engine to reserve blocks
    # at its next step boundary, so offered one at a time a queue of N entries paid N
    # decode steps before its last was taken; while the nodes' reported capacity holds
    # them all, up to this many go out together (in FIFO order; when the pool is full,
    # one at a time, and nothing overtakes a refused head).
    max_offers: int = 8
    block_size: int = 16  # for the room estimate, until nodes report theirs

    def __post_init__(self) -> None:
        if not 0 < self.lease_s <= 3600:
            raise ValueError(f"lease_s must be in (0, 3600], got {self.lease_s}")
        if self.max_wait_s <= 0 or not 0 < self.backoff_min_s <= self.backoff_max_s:
            raise ValueError("max_wait_s and backoffs must be positive, min <= max")
        if self.max_offers < 1 or self.block_size < 1:
            raise ValueError("max_offers and block_size must be >= 1")

    @property
    def extend_every_s(self) -> float:
        return self.lease_s / 3

    @property
    def tick_s(self) -> float:
        return min(1.0, self.extend_every_s / 2)


class InterStageQueue:
    """`start()` the dispatcher and housekeeping tasks inside the loop; `stop()` fails what
    is left (with a Cancel to its prefill node)."""

    def __init__(
        self,
        registry: NodeRegistry,
        client: NodeClient,
        metrics: InterStageMetrics,
        config: InterStageConfig | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.metrics = metrics
        self.config = config or InterStageConfig()
        self._entries: OrderedDict[str, QueueEntry] = OrderedDict()  # QUEUED or OFFERING
        self._work = asyncio.Event()
        self._capacity = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._refused: set[str] = set()  # entries every node refused, until a signal
        registry.add_lost_listener(self._node_lost)

    # -- the waiters' side -------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return len(self._entries)

    def oldest_wait_s(self, now: float) -> float:
        """How long the oldest waiting entry has waited for a decode node (0: none)."""
        head = next(iter(self._entries.values()), None)
        return now - head.enqueued_at if head is not None else 0.0

    def submit(self, request: DecodeRequest, prefill_url: str) -> QueueEntry:
        """Queue a prefilled request. The caller must end the entry with `wait` or
        `cancel`."""
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id} is already queued")
        loop = asyncio.get_running_loop()
        entry = QueueEntry(request, prefill_url, time.monotonic(), loop.create_future())
        self._entries[entry.request_id] = entry
        self._update_depth()
        self._work.set()
        return entry

    async def wait(self, entry: QueueEntry) -> NodeStream:
        """The accepted decode stream (the caller owns it from here), or the BackendError the
        entry failed with. Cancelling the waiter cancels the entry."""
        try:
            stream = await entry.future
        except asyncio.CancelledError:
            self.cancel(entry)
            raise
        entry.transition(EntryState.TAKEN)
        entry.stream = None
        return stream

    def cancel(self, entry: QueueEntry) -> None:
        """End `entry` wherever it is, sending Cancels from background tasks; a no-op once it
        is TAKEN, FAILED or CANCELLED. Never awaits."""
        state = entry.state
        if state in (EntryState.QUEUED, EntryState.OFFERING):
            self._leave(entry, EntryState.CANCELLED, "cancelled")
            self.client.cancel_soon(entry.prefill_url, entry.request_id)
        elif state is EntryState.DISPATCHED:
            entry.transition(EntryState.CANCELLED)
            self._drop_stream(entry, entry.stream)
        if entry.future.done() and not entry.future.cancelled():
            entry.future.exception()  # retrieved: no "never retrieved" warning
        entry.future.cancel()

    def notify_capacity(self) -> None:
        """Decode capacity may have freed up (a stream ended, a node came up)."""
        self._capacity.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._dispatch_forever(), name=f"interstage-dispatch-{i}")
            for i in range(self.config.max_offers)
        ]
        self._tasks.append(
            loop.create_task(self._housekeep_forever(), name="interstage-housekeeping")
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for entry in list(self._entries.values()):
            self._fail(entry, BackendError.unavailable("the proxy is shutting down"), "failed")

    # -- dispatcher --------------------------------------------------------------------------

    async def _dispatch_forever(self) -> None:
        """One of `config.max_offers` dispatchers: claim the first entry that may be offered
        now, offer it, and after a round in which every node was full keep it at the head
        (nothing behind it is claimed) until a capacity signal or the backoff."""
        backoff = self.config.backoff_min_s
        while True:
            entry = await self._claim()
            self._capacity.clear()  # a signal from now on means a new chance
            try:
                await self._offer(entry)
            except Exception:  # a bug: fail this entry, keep serving the others
                log.exception("%s: dispatch failed", entry.request_id)
                self._fail(entry, BackendError.failed("dispatch to decode failed"), "failed")
            finally:
                self._work.set()  # an offer ended: another may start
            if entry.state is not EntryState.OFFERING:
                backoff = self.config.backoff_min_s
                continue
            entry.transition(EntryState.QUEUED)  # every node is full: wait, keep the head
            self._refused.add(entry.request_id)
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._capacity.wait(), backoff)
            finally:
                self._refused.discard(entry.request_id)
                self._work.set()
            backoff = min(2 * backoff, self.config.backoff_max_s)

    async def _claim(self) -> QueueEntry:
        """The first QUEUED entry in FIFO order (now OFFERING), once it may be offered: alone,
        or beside the offers in flight when the decode pool as last seen has room for them
        all. Never one behind an entry that every node refused since the last signal."""
        while True:
            entry = self._claimable()
            if entry is not None:
                entry.transition(EntryState.OFFERING)
                return entry
            self._work.clear()
            await self._work.wait()

    def _claimable(self) -> QueueEntry | None:
        offering = offering_blocks = 0
        first: QueueEntry | None = None
        for entry in self._entries.values():
            if entry.state is EntryState.OFFERING:
                offering += 1
                offering_blocks += self._blocks_of(entry)
            elif first is None:
                if entry.request_id in self._refused:
                    return None  # waits at the head; nothing overtakes it
                first = entry
        if first is None or offering >= self.config.max_offers:
            return None
        blocks = offering_blocks + self._blocks_of(first)
        if offering == 0 or self._room_beside_offers(offering, blocks):
            return first
        return None

    def _room_beside_offers(self, offering: int, blocks: int) -> bool:
        """Whether the decode nodes' last reported capacity holds one more request beside
        the `offering` in flight, and `blocks` blocks for them all. A node that has not
        reported counts as none: then offers go one at a time."""
        slots = free = 0
        for node in self.registry.routable(Role.DECODE):
            spare = node.decode_spare()
            if spare is not None:
                slots, free = slots + max(spare[0], 0), free + max(spare[1], 0)
        return slots > offering and free >= blocks

    def _blocks_of(self, entry: QueueEntry) -> int:
        # The decode node reserves the prompt's blocks plus room for the first outputs, and
        # a copy of the last prompt block for each further choice.
        prompt_blocks = -(-len(entry.request.prompt_token_ids) // self.config.block_size)
        return prompt_blocks + entry.request.sampling.n

    async def _offer(self, entry: QueueEntry) -> None:
        """Offer `entry` to each decode node in turn until one accepts it (DISPATCHED), it
        fails or is cancelled; it stays OFFERING when every node is full."""
        for node in self.registry.decode_candidates(entry.request.prompt_token_ids):
            if entry.state is not EntryState.OFFERING:
                return
            try:
                stream = await self.client.open_stream(
                    node.url,
                    DECODE_PATH,
                    entry.request.model_copy(update={"epoch": node.epoch}),
                    entry.request_id,
                    stall_s=self.registry.stall_timeout(node.url),
                    kv_from=entry.prefill_url,
                )
            except DecodeFull:
                self.metrics.decode_full.inc()
                continue
            except NodeUnreachable as e:
                self.registry.report_failure(node.url, e.message)
                if e.maybe_received:
                    self.client.cancel_soon(node.url, entry.request_id)
                continue
            except BackendError as e:  # refused or failed: the node may hold a reservation
                self.client.cancel_soon(node.url, entry.request_id)
                self._fail(entry, e, "failed")
                return
            node.sent(0, kv_tokens=len(entry.request.prompt_token_ids))  # nothing to compute
            self._accept(entry, stream)
            return

    def _accept(self, entry: QueueEntry, stream: NodeStream) -> None:
        if entry.state is not EntryState.OFFERING or entry.future.done():
            # Cancelled while the offer was in flight (the prefill node has its Cancel).
            self._drop_stream(entry, stream, cancel_prefill=False)
            return
        self._leave(entry, EntryState.DISPATCHED, "dispatched")
        self.metrics.wait.observe(time.monotonic() - entry.enqueued_at)
        entry.stream = stream
        entry.future.set_result(stream)

    def _drop_stream(
        self, entry: QueueEntry, stream: NodeStream | None, cancel_prefill: bool = True
    ) -> None:
        """A decode stream nobody will read: close it and cancel the request on the decode
        node, and on the prefill node (the KV transfer may be in flight)."""
        if stream is not None:
            stream.close()
            self.client.cancel_soon(stream.url, entry.request_id)
        if cancel_prefill:
            self.client.cancel_soon(entry.prefill_url, entry.request_id)
        self.notify_capacity()

    def _node_lost(self, node: Node) -> None:
        """A prefill node is unreachable: the KV its waiting entries hold there is lost to
        them, so they fail now as NodeLost (their requests re-prefill elsewhere) instead of
        waiting for a transfer that cannot start."""
        for entry in list(self._entries.values()):
            if entry.prefill_url == node.url and entry.state is EntryState.QUEUED:
                error = NodeLost(
                    node.url,
                    f"prefill node {node.url} holding the request's KV is down",
                    True,
                    "node_down",
                )
                self._fail(entry, error, "node_lost")

    # -- housekeeping: leases and overdue entries --------------------------------------------

    async def _housekeep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            now = time.monotonic()
            self._expire_overdue(now)
            await self._extend_due(now)

    def _expire_overdue(self, now: float) -> None:
        for entry in list(self._entries.values()):
            if (
                entry.state is EntryState.QUEUED
                and now - entry.enqueued_at > self.config.max_wait_s
            ):
                error = BackendError.unavailable(
                    f"no decode capacity freed up within {self.config.max_wait_s:g} s",
                    retry_after=self.config.retry_after_s,
                )
                self._fail(entry, error, "expired")

    async def _extend_due(self, now: float) -> None:
        due: defaultdict[str, list[QueueEntry]] = defaultdict(list)
        for entry in self._entries.values():
            if now - entry.extended_at >= self.config.extend_every_s:
                due[entry.prefill_url].append(entry)
        calls = [
            self._extend_on(url, entries[i : i + MAX_IDS_PER_EXTEND])
            for url, entries in due.items()
            for i in range(0, len(entries), MAX_IDS_PER_EXTEND)
        ]
        await asyncio.gather(*calls)

    async def _extend_on(self, url: str, entries: list[QueueEntry]) -> None:
        sent_at = time.monotonic()
        msg = LeaseExtend(request_ids=[e.request_id for e in entries], lease_s=self.config.lease_s)
        try:
            result = await self.client.extend(url, msg)
        except NodeUnreachable as e:  # the node is gone, and the KV with it
            self.metrics.lease_extensions.labels("error").inc()
            for entry in entries:
                if entry.state is EntryState.QUEUED:
                    message = f"lost the prefilled KV: {e.message}"
                    self._fail(entry, NodeLost(url, message, True, "node_down"))
            return
        except BackendError as e:  # timed out or failed: the next tick tries again
            self.metrics.lease_extensions.labels("error").inc()
            log.warning("extending %d leases on %s failed: %s", len(entries), url, e.message)
            return
        self.metrics.lease_extensions.labels("ok").inc()
        self._apply_extension(entries, set(result.extended), set(result.missing), sent_at)

    def _apply_extension(
        self, entries: list[QueueEntry], extended: set[str], missing: set[str], sent_at: float
    ) -> None:
        for entry in entries:
            if entry.request_id in extended:
                entry.extended_at = sent_at
            elif entry.request_id in missing and entry.state is EntryState.QUEUED:
                # OFFERING ones may be "missing" because their transfer already started.
                error = NodeLost(
                    entry.prefill_url,
                    "the prefill node no longer holds the request's KV (lease expired)",
                    node_down=False,
                )
                self._fail(entry, error, "expired")

    # -- transitions -------------------------------------------------------------------------

    def _fail(self, entry: QueueEntry, error: BackendError, outcome: str = "failed") -> None:
        self._leave(entry, EntryState.FAILED, outcome)
        if not entry.future.done():
            entry.future.set_exception(error)
        self.client.cancel_soon(entry.prefill_url, entry.request_id)

    def _leave(self, entry: QueueEntry, state: EntryState, outcome: str) -> None:
        entry.transition(state)
        if self._entries.pop(entry.request_id, None) is entry:
            self.metrics.exits.labels(outcome).inc()
            self._update_depth()
            self._work.set()  # what waited behind it may go now

    def _update_depth(self) -> None:
        self.metrics.depth.set(len(self._entries))
