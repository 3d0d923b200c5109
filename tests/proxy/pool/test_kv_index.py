"""The proxy's index of the nodes' prefix caches, fed by a real ZeroMQ PUB socket in this
process: events apply in order; a gap (a lost batch) triggers a resync from the snapshot,
and events published meanwhile go on top of it; a node that leaves is forgotten."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from common.node.kv_events import KVEventPublisher
from common.wire.prefix import block_hashes, event_key
from proxy.pool.kv_index import KVIndex, NodeCache
from proxy.pool.node_state import Node, NodeState, NodeStatus, PrefixCacheInfo, Role

SALT, SECRET, BS = b"model/float32/16", "token-0123456789abcdef", 16


def test_a_node_cache_applies_in_order_and_reports_gaps() -> None:
    cache = NodeCache("u", "e", "tcp://x", 16, b"", capacity=3)
    assert not cache.apply(1, [[True, b"a"]])  # not synced yet
    cache.load(last=4, keys=[b"a"])
    # 3 and 4 are in the snapshot already; 5 is new
    assert cache.apply(3, [[True, b"old"], [False, b"a"], [True, b"b"]])
    assert cache.keys == {b"a", b"b"} and cache.next == 6
    assert cache.apply(6, [[False, b"a"]]) and cache.keys == {b"b"}
    assert not cache.apply(8, [[True, b"c"]])  # 7 is missing
    assert cache.matched_blocks([b"b", b"x"]) == 1
    assert not cache.apply(7, [[True, b"c"], [True, b"d"], [True, b"e"]])  # over capacity


def test_expected_blocks_count_until_stored_or_expired_and_stay_bounded() -> None:
    cache = NodeCache("u", "e", "tcp://x", 16, b"", capacity=4)
    cache.load(last=0, keys=[b"a"])
    cache.expect([b"a", b"b", b"c"], until=10.0, now=0.0)
    assert list(cache.pending) == [b"b", b"c"]  # "a" is stored already
    assert cache.matched_blocks([b"a", b"b", b"c", b"d"], now=5.0) == 3
    assert cache.matched_blocks([b"a", b"b", b"c"]) == 1  # without `now`: stored ones only
    assert cache.matched_blocks([b"a", b"b", b"c"], now=10.0) == 1  # expired
    cache.expect([b"d", b"e", b"f"], until=20.0, now=11.0)  # the expired ones go first
    assert list(cache.pending) == [b"d", b"e", b"f"]
    cache.expect([b"g", b"h"], until=21.0, now=12.0)  # over capacity: the oldest go
    assert list(cache.pending) == [b"e", b"f", b"g", b"h"]
    assert cache.apply(1, [[True, b"g"]]) and b"g" not in cache.pending and b"g" in cache.keys


class FakeClient:
    """The snapshot endpoint of one node: whatever `snapshot` holds when asked."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {"node": "e1", "last": 0, "keys": []}
        self.asked = 0

    async def kv_cache(self, url: str) -> dict[str, Any]:
        self.asked += 1
        return self.snapshot


def test_events_from_a_node_reach_the_router_and_a_gap_resyncs() -> None:
    prompt = list(range(100))  # 6 full blocks of 16
    hashes = block_hashes(prompt, BS, SALT)

    async def body() -> None:
        events: deque[tuple[int, str, int]] = deque()
        pub = KVEventPublisher("e1", events, "127.0.0.1", SECRET)
        client = FakeClient()
        index = KVIndex(client, SECRET)  # type: ignore[arg-type]
        reader = asyncio.get_running_loop().create_task(index.run())
        node = Node("http://n1", Role.PREFILL, status=NodeStatus.UP)
        node.state = NodeState(
            role="prefill", engine_id="e1", model_fingerprint="m", blocks={"total": 64},
            prefix_cache=PrefixCacheInfo(block_size=BS, salt=SALT.decode(), kv_events=pub.endpoint),
        )  # fmt: skip
        try:
            index.observe(node)

            async def until(cond: Any) -> None:
                deadline = time.monotonic() + 20.0  # generous: a loaded machine is slow
                while not cond():
                    if time.monotonic() > deadline:
                        raise AssertionError("never")
                    pub.flush()
                    await asyncio.sleep(0.01)

            await until(lambda: index.caches["http://n1"].next == 1)  # synced (empty)
            # ZeroMQ drops what a PUB sends before the subscription reaches it: keep
            # publishing the same first event until one gets through (a resync covers it).
            for i, h in enumerate(hashes[:4], start=1):
                events.append((i, "stored", h))
            await until(lambda: index.matched_tokens(node, prompt) == 64)
            # Events 5-6 are lost; 7 arrives: a gap, so the index asks for a snapshot.
            client.snapshot = {
                "node": "e1", "last": 8,
                "keys": [event_key(h, SECRET).hex() for h in hashes[:6]],
            }  # fmt: skip
            events.append((7, "stored", hashes[4]))
            await until(lambda: index.matched_tokens(node, prompt) == 96)
            assert index.gaps >= 1 and client.asked >= 2
            events.append((9, "removed", hashes[0]))  # after the snapshot: applies
            await until(lambda: index.matched_tokens(node, prompt) == 0)
            index.forget("http://n1")
            assert index.matched_tokens(node, prompt) == 0 and not index.caches
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            index.close()
            pub.close()

    asyncio.run(asyncio.wait_for(body(), 60))
