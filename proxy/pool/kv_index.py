"""The proxy's view of every node's prefix cache, kept from the nodes' KV events.

Each node publishes numbered "stored"/"removed" events for its cached blocks
(common/node/kv_events.py) on the endpoint its `/state` names. The index subscribes to each
node it sees, applies the events in order, and when the numbers skip (a missed batch, a
restarted node) resyncs from the node's snapshot (`GET /internal/kv_cache`) and applies only
what came after it. A node that leaves the pool, or comes back as another engine, leaves
the index. The index is bounded: a node's entry never holds more keys than the node has
blocks (it resyncs instead).

The router asks `matched_tokens(node, prompt)`: how many leading prompt tokens that node's
cache holds, in whole blocks. It also tells the index where it sent each prompt
(`expect(node, prompt)`): until that node's events report the blocks stored (or
`PENDING_TTL_S` passes), they count as held there, as in SGLang's router, which inserts a
prompt into its tree when it routes it. Without that, the requests of a new tenant that
arrive while its first prompt is still computing all look uncached everywhere, spread over
the nodes, and each node computes the same prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from common.wire.prefix import prompt_keys
from proxy.pool.client import NodeClient, NodeUnreachable
from proxy.pool.node_state import Node

log = logging.getLogger(__name__)

_RESYNC_BACKOFF_S = 0.5
PENDING_TTL_S = 30.0  # an expected block that never shows up (a failed prefill) is forgotten


@dataclass
class NodeCache:
    """One node's cached block keys, as of event number `next - 1`."""

    url: str
    engine_id: str
    endpoint: str
    block_size: int
    salt: bytes
    capacity: int  # the node's blocks: more keys than this means the books are off
    keys: set[bytes] = field(default_factory=set)
    next: int | None = None  # the event number expected next; None: not synced
    resyncs: int = 0
    # Batches that came while a snapshot was on its way: applied on top of it.
    held_back: list[tuple[int, list[Any]]] = field(default_factory=list)
    # Blocks of prompts routed here, not yet reported stored: key -> when to stop expecting
    # it (time.monotonic()); oldest first. At most `capacity` of them.
    pending: dict[bytes, float] = field(default_factory=dict)

    def apply(self, first: int, ops: list[Any]) -> bool:
        """Apply a batch; False if it does not follow on (a gap: resync)."""
        if self.next is None or first > self.next:
            return False
        for i, (stored, key) in enumerate(ops):
            if first + i < self.next:
                continue  # already in the snapshot
            key = bytes(key)
            self.pending.pop(key, None)
            if stored:
                self.keys.add(key)
            else:
                self.keys.discard(key)
        self.next = max(self.next, first + len(ops))
        return len(self.keys) <= self.capacity

    def load(self, last: int, keys: list[bytes]) -> None:
        self.keys, self.next = set(keys), last + 1

    def matched_blocks(self, keys: Sequence[bytes], now: float | None = None) -> int:
        """Leading blocks of `keys` held, or expected (pending) at `now`."""
        n = 0
        for key in keys:
            if key not in self.keys and (now is None or self.pending.get(key, 0.0) <= now):
                break
            n += 1
        return n

    def expect(self, keys: Sequence[bytes], until: float, now: float) -> None:
        """Count `keys` as held until `until`, unless the events say so first."""
        for key in keys:
            if key not in self.keys:
                self.pending.pop(key, None)  # re-inserted: the newest
                self.pending[key] = until
        excess = len(self.pending) - self.capacity
        for key, deadline in list(self.pending.items()):  # oldest first
            if excess <= 0 and deadline > now:
                break
            del self.pending[key]
            excess -= 1


class KVIndex:
    """Subscribes to every node's KV events; `run()` is the one task that reads them."""

    def __init__(self, client: NodeClient, secret: str | None) -> None:
        self.client = client
        self.secret = secret
        self.caches: dict[str, NodeCache] = {}  # by node URL
        self._by_engine: dict[str, NodeCache] = {}
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._resyncing: dict[str, asyncio.Task[None]] = {}
        self._keys_memo: tuple[tuple[int, ...], int, bytes, list[bytes]] | None = None
        self.gaps = 0

    # -- membership (called by the registry on every good poll) ----------------------------

    def observe(self, node: Node) -> None:
        """Follow `node` as its latest /state describes it (subscribe, or re-subscribe if it
        came back as another engine or on another endpoint)."""
        state = node.state
        info = state.prefix_cache if state is not None else None
        endpoint = info.kv_events if info is not None else None
        current = self.caches.get(node.url)
        if info is None or endpoint is None or state is None:
            if current is not None:
                self.forget(node.url)
            return
        if current is not None and (current.engine_id, current.endpoint) == (
            state.engine_id,
            endpoint,
        ):
            return
        if current is not None:
            self.forget(node.url)
        capacity = int(state.blocks.get("total", 0)) or 1 << 30
        cache = NodeCache(
            node.url, state.engine_id, endpoint, info.block_size, info.salt.encode(), capacity
        )
        self.caches[node.url] = cache
        self._by_engine[state.engine_id] = cache
        self._sub.connect(endpoint)
        self._resync_soon(cache)

    def forget(self, url: str) -> None:
        cache = self.caches.pop(url, None)
        if cache is None:
            return
        self._by_engine.pop(cache.engine_id, None)
        task = self._resyncing.pop(url, None)
        if task is not None:
            task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            self._sub.disconnect(cache.endpoint)

    # -- queries ----------------------------------------------------------------------------

    def matched_tokens(self, node: Node, prompt_token_ids: Sequence[int]) -> int:
        """Leading prompt tokens the node's cache holds (whole blocks; 0 if unknown)."""
        cache = self.caches.get(node.url)
        if cache is None or cache.next is None:
            return 0
        keys = self._keys(prompt_token_ids, cache.block_size, cache.salt)
        return cache.matched_blocks(keys, time.monotonic()) * cache.block_size

    def expect(self, node: Node, prompt_token_ids: Sequence[int]) -> None:
        """`node` was sent this prompt: its blocks count as held there until its events say
        they are stored, or for PENDING_TTL_S."""
        cache = self.caches.get(node.url)
        if cache is None or cache.next is None:
            return
        now = time.monotonic()
        keys = self._keys(prompt_token_ids, cache.block_size, cache.salt)
        cache.expect(keys, now + PENDING_TTL_S, now)

    def _keys(self, ids: Sequence[int], block_size: int, salt: bytes) -> list[bytes]:
        """The prompt's block keys; the last prompt's are kept (one request asks per node)."""
        memo = self._keys_memo
        key = tuple(ids)
        if memo is not None and memo[:3] == (key, block_size, salt):
            return memo[3]
        keys = prompt_keys(ids, block_size, salt, self.secret)
        self._keys_memo = (key, block_size, salt, keys)
        return keys

    # -- the subscriber ---------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            raw = await self._sub.recv()
            try:
                body = msgpack.unpackb(raw, raw=False)
                node, first, ops = body["node"], int(body["first"]), body["ops"]
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                log.warning("kv index: dropped a bad event batch: %s", e)
                continue
            cache = self._by_engine.get(node)
            if cache is None:
                continue
            if cache.next is None:  # a snapshot is on its way: these go on top of it
                cache.held_back.append((first, ops))
                if len(cache.held_back) > 10_000:
                    cache.held_back.clear()
                continue
            if not cache.apply(first, ops):
                self.gaps += 1
                log.info("kv index: events of %s skip to %d (expected %s): resync",
                         cache.url, first, cache.next)  # fmt: skip
                self._resync_soon(cache)

    def _resync_soon(self, cache: NodeCache) -> None:
        if cache.url in self._resyncing:
            return
        cache.next = None
        task = asyncio.get_running_loop().create_task(self._resync(cache))
        self._resyncing[cache.url] = task

    async def _resync(self, cache: NodeCache) -> None:
        try:
            while self.caches.get(cache.url) is cache:
                try:
                    snap = await self.client.kv_cache(cache.url)
                    keys = [bytes.fromhex(k) for k in snap["keys"]]
                    if snap["node"] != cache.engine_id:
                        return  # another engine now: the next poll re-subscribes
                    cache.load(int(snap["last"]), keys)
                    cache.resyncs += 1
                    held, cache.held_back = cache.held_back, []
                    for first, ops in held:
                        if not cache.apply(first, ops):
                            self.gaps += 1
                            cache.next = None  # try again
                            break
                    else:
                        return
                except (NodeUnreachable, KeyError, TypeError, ValueError) as e:
                    log.info("kv index: snapshot of %s failed (%s); retrying", cache.url, e)
                    await asyncio.sleep(_RESYNC_BACKOFF_S)
        finally:
            if self._resyncing.get(cache.url) is asyncio.current_task():
                del self._resyncing[cache.url]

    def close(self) -> None:
        for task in self._resyncing.values():
            task.cancel()
        self._resyncing.clear()
        self._sub.close(linger=0)
        self._ctx.term()
