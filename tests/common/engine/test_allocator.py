"""BlockAllocator against a simple model of its books (hypothesis state machine).

The model keeps, per allocated block, its references by the state each is held in, the
hash a block is registered under, and the order free blocks are handed out (blocks that
cache nothing first, then cached ones, least recently freed first). Every rule does one
operation on both; illegal operations must raise AllocatorError and change nothing.
Invariants compare the allocator's counts, states, references and cache to the model
after every step; teardown frees every reference and expects all blocks free (cached
free blocks count as free).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from common.engine.block_allocator import (
    AllocatorError,
    BlockAllocator,
    BlockState,
    block_hash,
    block_hashes,
)

ALLOCATED = (BlockState.USED, BlockState.HELD, BlockState.RESERVED)
LEGAL = {
    (BlockState.USED, BlockState.HELD),
    (BlockState.HELD, BlockState.USED),
    (BlockState.RESERVED, BlockState.USED),
}
STRENGTH = (BlockState.RESERVED, BlockState.HELD, BlockState.USED)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc: BlockAllocator
        self.total = 0
        self.holders: dict[int, Counter[BlockState]] = {}  # allocated blocks only
        self.hash: dict[int, int] = {}  # block -> the hash it is registered under
        self.free_order: list[int] = []
        self.next_hash = 1

    @initialize(num_blocks=st.integers(1, 12))
    def start(self, num_blocks: int) -> None:
        self.alloc = BlockAllocator(num_blocks)
        self.total = num_blocks
        self.free_order = list(range(num_blocks))

    # -- helpers ---------------------------------------------------------------

    def state_of(self, b: int) -> BlockState:
        for s in STRENGTH:
            if self.holders.get(b, Counter())[s]:
                return s
        return BlockState.FREE

    def references(self) -> list[tuple[int, BlockState]]:
        """One entry per outstanding reference: (block, the state it is held in)."""
        return [
            (b, s)
            for b, c in sorted(self.holders.items())
            for s, n in sorted(c.items())
            for _ in range(n)
        ]

    def drop(self, b: int, s: BlockState) -> None:
        self.holders[b][s] -= 1
        if not +self.holders[b]:
            del self.holders[b]
            if b in self.hash:
                self.free_order.append(b)  # cached: last in line
            else:
                self.free_order.insert(0, b)

    def snapshot(self) -> tuple:
        a = self.alloc
        return (
            a.counts(),
            a.cache_counts(),
            [a.holders(b) for b in range(self.total)],
            [a.hash_of(b) for b in range(self.total)],
        )

    def expect_error(self, op, *args) -> None:
        before = self.snapshot()
        with pytest.raises(AllocatorError):
            op(*args)
        assert self.snapshot() == before, "a refused operation changed the books"

    # -- legal operations ------------------------------------------------------

    @rule(data=st.data(), state=st.sampled_from(ALLOCATED))
    def allocate(self, data: st.DataObject, state: BlockState) -> None:
        n = data.draw(st.integers(0, len(self.free_order)), label="n")
        assert self.alloc.can_allocate(n)
        ids = self.alloc.allocate(n, state)
        taken, self.free_order = self.free_order[:n], self.free_order[n:]
        assert ids == taken  # uncached first, then the least recently freed cached block
        for b in ids:
            self.hash.pop(b, None)  # evicted
            self.holders[b] = Counter({state: 1})

    @rule(data=st.data(), state=st.sampled_from(ALLOCATED))
    def share(self, data: st.DataObject, state: BlockState) -> None:
        shareable = sorted(set(self.holders) | set(self.hash))
        if not shareable:
            return
        ids = data.draw(st.lists(st.sampled_from(shareable), min_size=1, unique=True))
        self.alloc.share(ids, state)
        for b in ids:
            if b not in self.holders:
                self.free_order.remove(b)
                self.holders[b] = Counter()
            self.holders[b][state] += 1

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # A random handful of outstanding references, all in one state, in random order
        # (a block with two references may be freed twice in one call).
        refs = self.references()
        s = data.draw(st.sampled_from(sorted({s for _, s in refs})), label="state")
        mine = data.draw(st.permutations([b for b, x in refs if x is s]), label="order")
        k = data.draw(st.integers(1, len(mine)), label="k")
        self.alloc.free(mine[:k], s)
        for b in mine[:k]:
            self.drop(b, s)

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), new=st.sampled_from([BlockState.USED, BlockState.HELD]))
    def legal_transition(self, data: st.DataObject, new: BlockState) -> None:
        olds = sorted({s for _, s in self.references() if (s, new) in LEGAL})
        if not olds:
            return
        old = data.draw(st.sampled_from(olds), label="old")
        movable = sorted({b for b, s in self.references() if s is old})
        ids = data.draw(st.lists(st.sampled_from(movable), min_size=1, unique=True))
        self.alloc.transition(ids, new, old)
        for b in ids:
            self.holders[b][old] -= 1
            self.holders[b][new] += 1

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), reuse=st.booleans())
    def register(self, data: st.DataObject, reuse: bool) -> None:
        b = data.draw(st.sampled_from(sorted(self.holders)), label="block")
        if b in self.hash:  # named already (and maybe shared into a reservation since)
            assert self.alloc.register(b, self.next_hash) is False
            return
        if self.holders[b][BlockState.RESERVED]:  # its bytes may still be coming
            self.expect_error(self.alloc.register, b, self.next_hash)
            return
        if reuse and self.hash:  # another block's content: refused, nothing changes
            h = data.draw(st.sampled_from(sorted(self.hash.values())), label="taken")
            assert self.alloc.register(b, h) is False
            return
        ok = self.alloc.register(b, self.next_hash)
        assert ok == (b not in self.hash)
        if ok:
            self.hash[b] = self.next_hash
        self.next_hash += 1

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        known = sorted(self.hash.values())
        chain = data.draw(
            st.lists(st.one_of(st.sampled_from(known), st.just(-1)) if known else st.just(-1))
        )
        by_hash = {h: b for b, h in self.hash.items()}
        expected = []
        for h in chain:
            if h not in by_hash:
                break
            expected.append(by_hash[h])
        assert self.alloc.lookup(chain) == expected

    # -- illegal operations ----------------------------------------------------

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), new=st.sampled_from(list(BlockState)))
    def illegal_transition(self, data: st.DataObject, new: BlockState) -> None:
        refs = self.references()
        old = data.draw(st.sampled_from(sorted({s for _, s in refs})), label="old")
        if (old, new) in LEGAL:
            return
        ids = sorted({b for b, s in refs if s is old})
        self.expect_error(self.alloc.transition, ids, new, old)

    @precondition(lambda self: self.free_order)
    @rule(data=st.data())
    def ops_on_a_free_block(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.free_order), label="free block")
        self.expect_error(self.alloc.free, [b])
        self.expect_error(self.alloc.fork, [b])
        self.expect_error(self.alloc.transition, [b], BlockState.USED)
        self.expect_error(self.alloc.register, b, self.next_hash)
        if b not in self.hash:
            self.expect_error(self.alloc.share, [b])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free_in_the_wrong_state(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(self.holders)), label="block")
        absent = [s for s in ALLOCATED if not self.holders[b][s]]
        if absent:
            self.expect_error(self.alloc.free, [b], absent[0])
        if len(+self.holders[b]) > 1:  # held in two states: it must be named
            self.expect_error(self.alloc.free, [b])

    @rule(extra=st.integers(1, 3), state=st.sampled_from(ALLOCATED))
    def over_allocate(self, extra: int, state: BlockState) -> None:
        n = len(self.free_order) + extra
        assert not self.alloc.can_allocate(n)
        self.expect_error(self.alloc.allocate, n, state)

    @rule()
    def refused_arguments(self) -> None:
        assert not self.alloc.can_allocate(-1)
        self.expect_error(self.alloc.allocate, 0, BlockState.FREE)
        self.expect_error(self.alloc.free, [self.total])
        self.expect_error(self.alloc.fork, [-1])
        self.expect_error(self.alloc.share, [self.total])

    # -- invariants ------------------------------------------------------------

    @invariant()
    def books_agree(self) -> None:
        self.alloc.check_integrity()
        counts = self.alloc.counts()
        expected = {s.value: 0 for s in BlockState}
        for b in range(self.total):
            expected[self.state_of(b).value] += 1
        assert counts == {**expected, "total": self.total}
        assert self.alloc.num_free == len(self.free_order) == expected["free"]
        for b in range(self.total):
            assert self.alloc.state(b) is self.state_of(b)
            assert self.alloc.holders(b) == dict(+self.holders.get(b, Counter()))
            assert self.alloc.ref_count(b) == sum(self.holders.get(b, Counter()).values())
            assert self.alloc.hash_of(b) == self.hash.get(b)
            assert self.alloc.is_cached_free(b) == (b in self.hash and b not in self.holders)

    def teardown(self) -> None:
        if not self.total:
            return
        for s in ALLOCATED:
            self.alloc.free([b for b, x in self.references() if x is s], s)
            for b, x in self.references():
                if x is s:
                    self.drop(b, s)
        self.alloc.check_integrity()
        assert self.alloc.counts() == {
            "free": self.total,
            "used": 0,
            "held": 0,
            "reserved": 0,
            "total": self.total,
        }
        assert self.alloc.can_allocate(self.total)


AllocatorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestAllocator = AllocatorMachine.TestCase


def test_rejects_nonpositive_size() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_chained_hashes_name_a_prefix_and_everything_before_it() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # full blocks only
    assert a == block_hashes(list(range(32)), 16)
    assert a[:1] == block_hashes(list(range(16)) + [99] * 16, 16)[:1]
    assert a[1] != block_hashes(list(range(16)) + [99] * 16, 16)[1]
    # The same tokens after another prefix, or under another salt, are other KV.
    assert block_hash(None, range(16, 32)) != a[1]
    assert block_hashes(list(range(32)), 16, b"other model") != a
    assert block_hashes(list(range(48)), 16, start=a) == block_hashes(list(range(48)), 16)


def test_a_cached_block_survives_its_last_reference_until_space_is_needed() -> None:
    alloc = BlockAllocator(3)
    a, b, c = alloc.allocate(3)
    assert alloc.register(a, 111) and alloc.register(b, 222)
    alloc.free([a, b, c])
    assert alloc.counts()["free"] == 3 and alloc.cache_counts()["cached_free"] == 2
    assert alloc.lookup([111, 222, 333]) == [a, b]
    alloc.share([a])  # a hit revives it
    assert alloc.allocate(1) == [c]  # the uncached block goes first
    assert alloc.allocate(1) == [b]  # then the least recently freed cached one is evicted
    assert alloc.lookup([111, 222]) == [a] and alloc.cache_counts()["evictions"] == 1


def test_reset_cache_forgets_only_the_free_cached_blocks() -> None:
    a = BlockAllocator(8)
    events = a.record_events()
    held, freed = a.allocate(2), a.allocate(3)
    for b in held + freed:
        assert a.register(b, 1000 + b)
    a.free(freed)
    assert a.num_cached == 5
    assert a.reset_cache() == 3
    assert a.num_cached == 2 and a.lookup([1000 + held[0]]) == [held[0]]
    assert all(a.hash_of(b) is None for b in freed)
    assert [kind for _, kind, _ in events].count("removed") == 3
    a.check_integrity()
    # the forgotten blocks are reused before any other free block
    assert sorted(a.allocate(3)) == sorted(freed)
    assert a.reset_cache() == 0
