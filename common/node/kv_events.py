"""KV events: a node tells routers which prompt prefixes its cache holds.

Like vLLM's and Dynamo's KV events: every block the engine registers in its prefix cache
("stored") or evicts from it ("removed") is numbered (BlockAllocator.record_events) and
published on a ZeroMQ PUB socket, in batches:

    msgpack {"node": engine id, "first": number of the first event, "ops": [[stored?, key]]}

Numbers are consecutive, so a subscriber that sees a batch not starting where the last one
ended knows it missed some (a slow subscriber, a dropped batch, a restart) and resyncs from
the snapshot (`GET /internal/kv_cache`: the last event's number and every key), applying
only later events on top.

A batch goes out FLUSH_INTERVAL_S after the first event since the last one (so that the
events of one step travel together); an idle node sends nothing and does not wake: the
allocator calls `notify` as it queues each event, and the first since the last flush wakes
the publisher's task.

Keys are not the engine's block hashes but a keyed digest of them (`event_key`): with a
cluster token, only a holder of the token can tell which prompt prefixes a node caches.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import msgpack
import zmq

from common.wire.prefix import event_key

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.02
_MAX_OPS_PER_BATCH = 4096


def batches(
    events: list[tuple[int, str, int]], secret: str | None
) -> list[tuple[int, list[list[Any]]]]:
    """Events (number, kind, hash) as (first number, ops) runs of consecutive numbers."""
    out: list[tuple[int, list[list[Any]]]] = []
    for number, kind, h in events:
        op = [kind == "stored", event_key(h, secret)]
        if out and out[-1][0] + len(out[-1][1]) == number and len(out[-1][1]) < _MAX_OPS_PER_BATCH:
            out[-1][1].append(op)
        else:
            out.append((number, [op]))
    return out


class KVEventPublisher:
    """Drains the engine's event queue on the node's loop and publishes it."""

    def __init__(self, engine_id: str, events: deque[tuple[int, str, int]], host: str,
                 secret: str | None) -> None:  # fmt: skip
        self.engine_id = engine_id
        self._events = events
        self._secret = secret
        self._ctx = zmq.Context(io_threads=1)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        port = self._pub.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.dropped = 0  # batches the socket refused (a subscriber then resyncs)
        self.flushes = 0  # wake-ups that flushed (none while the node is idle)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._woken = False  # a wake-up is on its way; the next event need not send one

    def notify(self) -> None:
        """Any thread (the engine's, as the allocator queues an event): the first event
        since the last flush wakes `run`; the others ride with it."""
        loop = self._loop
        if self._woken or loop is None:
            return
        self._woken = True
        try:
            loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop closed (node shutting down): nothing to publish to
            pass

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.flush()  # what was queued before this task ran
        while True:
            await self._wake.wait()
            await asyncio.sleep(FLUSH_INTERVAL_S)  # the rest of the step's events
            # Cleared before the drain: an event queued from here on wakes the next round,
            # one queued before is in this drain.
            self._wake.clear()
            self._woken = False
            self.flush()
            self.flushes += 1

    def flush(self) -> None:
        drained = []
        while self._events:
            drained.append(self._events.popleft())
        for first, ops in batches(drained, self._secret):
            body = {"node": self.engine_id, "first": first, "ops": ops}
            try:
                self._pub.send(msgpack.packb(body, use_bin_type=True), zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1

    def close(self) -> None:
        self._loop = None
        self._pub.close(linger=0)
        self._ctx.term()
