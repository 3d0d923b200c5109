"""The KV-event publisher: batches go out shortly after the engine's activity nudges it,
and events made without a nudge still go out (at the idle flush), in order."""

from __future__ import annotations

import asyncio
from collections import deque

import msgpack
import zmq
import zmq.asyncio

from common.node.kv_events import KVEventPublisher


def test_nudged_and_unnudged_events_are_published_in_order() -> None:
    async def body() -> None:
        events: deque[tuple[int, str, int]] = deque()
        pub = KVEventPublisher("e1", events, "127.0.0.1", None)
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        runner = asyncio.get_running_loop().create_task(pub.run())
        try:
            # A PUB drops what it sends before the subscription reaches it: send event 1
            # until a batch arrives.
            got: list[dict] = []
            while not got:
                events.append((1, "stored", 11))
                pub.nudge()
                try:
                    got.append(msgpack.unpackb(await asyncio.wait_for(sub.recv(), 0.5)))
                except asyncio.TimeoutError:
                    pass
            assert got[0]["node"] == "e1" and got[0]["first"] == 1
            events.append((2, "stored", 12))  # no nudge: the idle flush sends it
            later = msgpack.unpackb(await asyncio.wait_for(sub.recv(), 10.0))
            while later["first"] == 1:  # (a repeat of event 1 from the loop above)
                later = msgpack.unpackb(await asyncio.wait_for(sub.recv(), 10.0))
            assert later["first"] == 2 and len(later["ops"]) == 1
            assert later["ops"][0][0] is True
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            sub.close(linger=0)
            ctx.term()
            pub.close()

    asyncio.run(asyncio.wait_for(body(), 60))
