"""The node's KV block allocator: the only place a block is freed, and the prefix cache.

A block is FREE (no reference) or allocated. Each reference to an allocated block is held
in one state, by one owner:
    USED      computed or being computed for a local sequence
    HELD      prompt KV kept by a prefill node for transfer (under a lease)
    RESERVED  destination reserved by a decode node for an incoming transfer
A block may have several references (prefix sharing), possibly in different states (a
prompt prefix HELD for one transfer and USED by a running sequence); it is FREE again when
its last reference is dropped. Each block counts once in `counts()`, in its strongest
state (RESERVED, then HELD, then USED).

Prefix cache: a full block whose KV is computed may be registered under its chained hash
(`block_hash`). Registered blocks are found by `lookup` and shared by `share`; when their
last reference goes they stay on the free list, still registered, as *cached* blocks:
free (they count as free), and reused by a later `lookup` until `allocate` needs them.
`allocate` takes blocks that cache nothing first, then the least recently freed cached
ones (LRU eviction). With `record_events()`, every registration and eviction is numbered
and queued in `events` (KV events: a router's view of this cache). A block with a RESERVED
reference cannot be registered (its bytes may still be coming); a registered block may be
shared into a reservation (a decode node's cached prefix, which the transfer then skips).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from enum import Enum

from common.wire.fsm import Transitions
from common.wire.prefix import block_hash as block_hash
from common.wire.prefix import block_hashes as block_hashes


class BlockState(str, Enum):
    FREE = "free"
    USED = "used"
    HELD = "held"
    RESERVED = "reserved"


# Legal state changes of one reference (freeing is separate: see `free`).
MOVES: Transitions[BlockState] = Transitions(
    "block",
    {
        BlockState.USED: {BlockState.HELD},
        BlockState.HELD: {BlockState.USED},
        BlockState.RESERVED: {BlockState.USED},
        BlockState.FREE: set(),
    },
)

_STRENGTH = (BlockState.RESERVED, BlockState.HELD, BlockState.USED)


class AllocatorError(RuntimeError):
    """An illegal allocator operation: a bug in the caller, never user input."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # Free blocks in allocation order: uncached first, then cached, least recent first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._holders: list[Counter[BlockState]] = [Counter() for _ in range(num_blocks)]
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._counts = {s: 0 for s in BlockState}
        self._counts[BlockState.FREE] = num_blocks
        self._shared = 0  # blocks with more than one reference
        self._cached_free = 0  # registered blocks without references
        self.evictions = 0
        # KV events: (number, "stored" | "removed", hash), numbered from 1; None: not kept.
        # Bounded: a consumer that falls behind sees a gap in the numbers and resyncs.
        self.events: deque[tuple[int, str, int]] | None = None
        self.event_no = 0
        self.on_event: Callable[[], None] | None = None  # see record_events

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included (they are reused before anything is refused)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks (free or not)."""
        return len(self._by_hash)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int, state: BlockState = BlockState.USED) -> list[int]:
        """Take `n` free blocks into `state` with one reference each (evicting cached ones
        if the uncached run out)."""
        if state is BlockState.FREE:
            raise AllocatorError("cannot allocate into FREE")
        if not self.can_allocate(n):
            raise AllocatorError(f"asked for {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._unregister(b)
            self._take(b, state)
            ids.append(b)
        return ids

    def share(self, block_ids: Iterable[int], state: BlockState = BlockState.USED) -> None:
        """Add a reference in `state` to each block: allocated ones, or cached free ones
        (which leave the free list). All or nothing."""
        if state is BlockState.FREE:
            raise AllocatorError("cannot share into FREE")
        ids = list(block_ids)
        for b in ids:
            self._require_range(b)
            if self._ref[b] == 0 and self._hash[b] is None:
                raise AllocatorError(f"block {b} is free and caches nothing")
        for b in ids:
            if self._ref[b] == 0:
                del self._free[b]
                self._take(b, state)
            else:
                self._add_ref(b, state)

    def fork(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each (allocated) block, in its current state. All or nothing."""
        ids = list(block_ids)
        for b in ids:
            self._require_allocated(b)
        for b in ids:
            self._add_ref(b, self.state(b))

    def free(self, block_ids: Iterable[int], state: BlockState | None = None) -> None:
        """Drop one reference from each block (held in `state`; default: the block's own
        state, which must then be its only one); a block at zero refs becomes FREE (and
        stays cached if registered).

        All or nothing: a call naming a free block, or dropping more references than a
        block has in that state, raises before changing anything.
        """
        ids = list(block_ids)
        states: dict[int, BlockState] = {}
        for b, n in Counter(ids).items():
            self._require_allocated(b)
            s = states[b] = state if state is not None else self._only_state(b)
            if n > self._holders[b][s]:
                raise AllocatorError(
                    f"block {b}: {n} frees for {self._holders[b][s]} {s.value} references"
                )
        for b in ids:  # in the caller's order: it decides which block is reused first
            self._drop_ref(b, states[b])

    def transition(
        self, block_ids: Iterable[int], new: BlockState, old: BlockState | None = None
    ) -> None:
        """Move one reference of each block from `old` (default: its only state) to `new`
        (USED->HELD, HELD->USED, RESERVED->USED). All or nothing."""
        ids = list(block_ids)
        states: dict[int, BlockState] = {}
        for b, n in Counter(ids).items():
            self._require_allocated(b)
            s = states[b] = old if old is not None else self._only_state(b)
            if not MOVES.allows(s, new) or self._holders[b][s] < n:
                raise AllocatorError(f"block {b}: illegal {s.value} -> {new.value}")
        for b in ids:
            s = states[b]
            before = self.state(b)
            self._holders[b][s] -= 1
            self._holders[b][new] += 1
            self._recount(b, before)

    # -- the prefix cache ---------------------------------------------------------------

    def register(self, block_id: int, h: int) -> bool:
        """Name an allocated, computed, full block by its chained hash. False (and nothing
        changes) if the block is already named, or another block holds that content."""
        self._require_allocated(block_id)
        if self._hash[block_id] is not None or h in self._by_hash:
            return False  # (a named block may be shared into reservations: that is fine)
        if self._holders[block_id][BlockState.RESERVED]:
            raise AllocatorError(f"block {block_id}: a RESERVED block cannot be registered")
        self._hash[block_id] = h
        self._by_hash[h] = block_id
        self._event("stored", h)
        return True

    def reset_cache(self) -> int:
        """Forget the content of every free cached block (vLLM's reset_prefix_cache): they
        become plain free blocks, first in line, each with a "removed" event. Blocks that
        requests hold keep their names (their bytes are still what the hash says). Returns
        how many were forgotten."""
        dropped = [b for b in self._free if self._hash[b] is not None]
        for b in dropped:
            self._unregister(b)
            self._free.move_to_end(b, last=False)
        return len(dropped)

    def record_events(self, limit: int = 1_000_000) -> deque[tuple[int, str, int]]:
        """Start queueing KV events in `events` (the oldest dropped beyond `limit`); then
        `on_event`, if set, is called after each one is queued, on the thread that made it."""
        self.events = deque(maxlen=limit)
        return self.events

    def cached_hashes(self) -> tuple[int, list[int]]:
        """(the number of the last event, every registered hash): a snapshot consistent
        with the event stream (engine thread)."""
        return self.event_no, list(self._by_hash)

    def _event(self, kind: str, h: int) -> None:
        self.event_no += 1
        if self.events is not None:
            self.events.append((self.event_no, kind, h))
            if self.on_event is not None:
                self.on_event()

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes` (allocated or free)."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def hash_of(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def is_cached_free(self, block_id: int) -> bool:
        return self._ref[block_id] == 0 and self._hash[block_id] is not None

    # -- introspection --------------------------------------------------------------------

    def state(self, block_id: int) -> BlockState:
        """FREE, or the strongest state any reference to the block is held in."""
        holders = self._holders[block_id]
        for s in _STRENGTH:
            if holders[s]:
                return s
        return BlockState.FREE

    def holders(self, block_id: int) -> dict[BlockState, int]:
        """References to the block, by the state each is held in."""
        return {s: n for s, n in self._holders[block_id].items() if n}

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def counts(self) -> dict[str, int]:
        """Blocks per state (each once, in its strongest state) plus the total; cached free
        blocks count as free."""
        out = {s.value: self._counts[s] for s in BlockState}
        out["total"] = self.num_blocks
        return out

    def cache_counts(self) -> dict[str, int]:
        """The prefix cache: registered blocks, those free (evictable), those shared (O(1):
        it is published after every step)."""
        return {
            "cached": len(self._by_hash),
            "cached_free": self._cached_free,
            "shared": self._shared,
            "evictions": self.evictions,
        }

    def check_integrity(self) -> None:
        """Assert the books balance: each block once, in one state; free blocks are exactly
        those without references; the hash index and the block names agree. Cached free
        blocks count as free."""
        c = self._counts
        assert sum(c.values()) == self.num_blocks, c
        assert len(self._free) == c[BlockState.FREE], (len(self._free), c)
        seen = dict.fromkeys(BlockState, 0)
        shared = cached_free = 0
        free, hashes, by_hash = self._free, self._hash, self._by_hash
        for b, (holders, ref, h) in enumerate(zip(self._holders, self._ref, hashes, strict=True)):
            assert h is None or by_hash.get(h) == b, (b, h)
            if ref == 0:  # most blocks, when idle: keep this path short
                assert not holders and b in free, (b, holders)
                seen[BlockState.FREE] += 1
                cached_free += h is not None
                continue
            seen[self.state(b)] += 1
            assert sum(holders.values()) == ref and min(holders.values()) >= 0, (b, holders)
            assert b not in free, b
            shared += ref > 1
        assert seen == c, (seen, c)
        assert (shared, cached_free) == (self._shared, self._cached_free), (shared, cached_free)
        assert all(self._hash[b] == h for h, b in self._by_hash.items())

    # -- internals ------------------------------------------------------------------------

    def _take(self, b: int, state: BlockState) -> None:
        """A free block (already off the free list) gets its first reference."""
        if self._hash[b] is not None:
            self._cached_free -= 1
        self._ref[b] = 1
        self._holders[b] = Counter({state: 1})
        self._counts[BlockState.FREE] -= 1
        self._counts[state] += 1

    def _add_ref(self, b: int, state: BlockState) -> None:
        before = self.state(b)
        self._ref[b] += 1
        self._shared += self._ref[b] == 2
        self._holders[b][state] += 1
        self._recount(b, before)

    def _drop_ref(self, b: int, state: BlockState) -> None:
        before = self.state(b)
        self._ref[b] -= 1
        self._shared -= self._ref[b] == 1
        self._holders[b][state] -= 1
        if self._ref[b]:
            self._recount(b, before)
            return
        self._cached_free += self._hash[b] is not None
        self._holders[b] = Counter()
        self._counts[before] -= 1
        self._counts[BlockState.FREE] += 1
        self._free[b] = None  # cached: last in line for eviction
        if self._hash[b] is None:
            self._free.move_to_end(b, last=False)  # uncached: first to be reused

    def _recount(self, b: int, before: BlockState) -> None:
        after = self.state(b)
        if after is not before:
            self._counts[before] -= 1
            self._counts[after] += 1

    def _unregister(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            del self._by_hash[h]
            self._hash[b] = None
            self.evictions += 1
            self._cached_free -= self._ref[b] == 0
            self._event("removed", h)

    def _only_state(self, b: int) -> BlockState:
        states = [s for s, n in self._holders[b].items() if n]
        if len(states) != 1:
            raise AllocatorError(
                f"block {b} is held in {sorted(s.value for s in states)}: name the state"
            )
        return states[0]

    def _require_range(self, b: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise AllocatorError(f"block id {b} out of range [0, {self.num_blocks})")

    def _require_allocated(self, b: int) -> None:
        self._require_range(b)
        if self._ref[b] == 0:
            raise AllocatorError(f"block {b} is free (double free or stale id)")
