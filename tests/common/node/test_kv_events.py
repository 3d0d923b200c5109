"""The KV-event publisher wakes only for events: a subscriber gets the events an engine-side
thread queues (through the allocator's `on_event`), and an idle publisher neither flushes
nor wakes; after `close`, an event's notification is a no-op."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from common.engine.block_allocator import BlockAllocator
from common.node.kv_events import KVEventPublisher


def test_events_queued_from_another_thread_are_published_and_an_idle_publisher_sleeps() -> None:
    allocator = BlockAllocator(8)
    events = allocator.record_events()
    pub = KVEventPublisher("e1", events, "127.0.0.1", None)
    allocator.on_event = pub.notify

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        task = asyncio.get_running_loop().create_task(pub.run())
        try:
            await asyncio.sleep(0.3)  # idle: nothing queued, so nothing wakes it
            assert pub.flushes == 0
            received: list[dict[str, Any]] = []
            # ZeroMQ drops what a PUB sends before the subscription reaches it: register
            # blocks (each a "stored" event, queued on this other thread, as the engine
            # thread does) until one batch gets through.
            deadline = time.monotonic() + 20.0  # generous: a loaded machine is slow
            block = 0
            while not received:
                assert time.monotonic() < deadline, "no batch ever arrived"
                b = allocator.allocate(1)
                made = threading.Thread(target=allocator.register, args=(b[0], 1000 + block))
                made.start()
                made.join()
                block += 1
                if await sub.poll(200):
                    received.append(msgpack.unpackb(await sub.recv(), raw=False))
                allocator.free(b)
            body = received[0]
            assert body["node"] == "e1" and any(stored for stored, _ in body["ops"])
            assert pub.flushes >= 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sub.close(linger=0)
            ctx.term()
            pub.close()

    asyncio.run(asyncio.wait_for(body(), 60))
    allocator.register(allocator.allocate(1)[0], 7)  # after close: queued, nothing sent
    assert events
