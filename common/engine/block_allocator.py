"""The node's KV block allocator: the only place a block is freed.

Every block is in exactly one state:
    FREE      on the free list, ref count 0
    USED      computed or being computed for a local sequence
    HELD      prompt KV kept by a prefill node for transfer (under a lease)
    RESERVED  destination reserved by a decode node for an incoming transfer
Non-free blocks carry a ref count >= 1 (`fork` shares a block); a block returns
to the free list when its last reference is freed.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from enum import Enum

from common.wire.fsm import Transitions


class BlockState(str, Enum):
    FREE = "free"
    USED = "used"
    HELD = "held"
    RESERVED = "reserved"


# Legal state changes of allocated blocks (freeing is separate: see `free`).
MOVES: Transitions[BlockState] = Transitions(
    "block",
    {
        BlockState.USED: {BlockState.HELD},
        BlockState.HELD: {BlockState.USED},
        BlockState.RESERVED: {BlockState.USED},
        BlockState.FREE: set(),
    },
)


class AllocatorError(RuntimeError):
    """An illegal allocator operation: a bug in the caller, never user input."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._state = [BlockState.FREE] * num_blocks
        self._counts = {s: 0 for s in BlockState}
        self._counts[BlockState.FREE] = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int, state: BlockState = BlockState.USED) -> list[int]:
        """Take `n` free blocks into `state` with ref count 1."""
        if state is BlockState.FREE:
            raise AllocatorError("cannot allocate into FREE")
        if not self.can_allocate(n):
            raise AllocatorError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._ref[b] = 1
            self._state[b] = state
        self._counts[BlockState.FREE] -= n
        self._counts[state] += n
        return ids

    def fork(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each (allocated) block. All or nothing."""
        ids = list(block_ids)
        for b in ids:
            self._require_allocated(b)
        for b in ids:
            self._ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block at zero refs becomes FREE.

        All or nothing: a call naming a free block, or dropping more references
        than a block has, raises before changing anything.
        """
        ids = list(block_ids)
        for b, n in Counter(ids).items():
            self._require_allocated(b)
            if n > self._ref[b]:
                raise AllocatorError(f"block {b}: {n} frees for {self._ref[b]} references")
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._counts[self._state[b]] -= 1
                self._counts[BlockState.FREE] += 1
                self._state[b] = BlockState.FREE
                self._free.append(b)

    def transition(self, block_ids: Iterable[int], new: BlockState) -> None:
        """Move allocated blocks to `new` (USED->HELD, HELD->USED, RESERVED->USED)."""
        ids = list(block_ids)
        for b in ids:
            self._require_allocated(b)
            if not MOVES.allows(self._state[b], new):
                raise AllocatorError(f"block {b}: illegal {self._state[b].value} -> {new.value}")
        for b in ids:
            self._counts[self._state[b]] -= 1
            self._counts[new] += 1
            self._state[b] = new

    def state(self, block_id: int) -> BlockState:
        return self._state[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def counts(self) -> dict[str, int]:
        """Blocks per state plus the total, as a later /state endpoint shows them."""
        out = {s.value: self._counts[s] for s in BlockState}
        out["total"] = self.num_blocks
        return out

    def check_integrity(self) -> None:
        """Assert free + used + held + reserved == total and the books agree."""
        c = self._counts
        assert sum(c.values()) == self.num_blocks, c
        assert len(set(self._free)) == len(self._free) == c[BlockState.FREE]
        for s in BlockState:
            assert sum(1 for x in self._state if x is s) == c[s], (s, c)
        for b in range(self.num_blocks):
            free = self._state[b] is BlockState.FREE
            assert free == (self._ref[b] == 0), (b, self._state[b], self._ref[b])
        assert all(self._state[b] is BlockState.FREE for b in self._free)

    def _require_allocated(self, b: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise AllocatorError(f"block id {b} out of range [0, {self.num_blocks})")
        if self._ref[b] == 0:
            raise AllocatorError(f"block {b} is free (double free or stale id)")
