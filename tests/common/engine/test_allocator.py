"""BlockAllocator against a simple model of its books (hypothesis state machine).

The model keeps, per allocated block, its state and ref count. Every rule does
one operation on both; illegal operations must raise AllocatorError and change
nothing. Invariants compare the allocator's counts, states and ref counts to the
model after every step; teardown frees every reference and expects all blocks free.
"""

from __future__ import annotations

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

from common.engine.block_allocator import AllocatorError, BlockAllocator, BlockState

ALLOCATED = (BlockState.USED, BlockState.HELD, BlockState.RESERVED)
LEGAL = {
    (BlockState.USED, BlockState.HELD),
    (BlockState.HELD, BlockState.USED),
    (BlockState.RESERVED, BlockState.USED),
}


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc: BlockAllocator
        self.total = 0
        self.state: dict[int, BlockState] = {}  # allocated blocks only
        self.refs: dict[int, int] = {}

    @initialize(num_blocks=st.integers(1, 12))
    def start(self, num_blocks: int) -> None:
        self.alloc = BlockAllocator(num_blocks)
        self.total = num_blocks

    # -- helpers ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.total - len(self.state)

    def free_ids(self) -> list[int]:
        return [b for b in range(self.total) if b not in self.state]

    def references(self) -> list[int]:
        """One entry per outstanding reference."""
        return [b for b, n in sorted(self.refs.items()) for _ in range(n)]

    def snapshot(self) -> tuple:
        a = self.alloc
        return (
            a.counts(),
            [a.state(b) for b in range(self.total)],
            [a.ref_count(b) for b in range(self.total)],
        )

    def expect_error(self, op, *args) -> None:
        before = self.snapshot()
        with pytest.raises(AllocatorError):
            op(*args)
        assert self.snapshot() == before, "a refused operation changed the books"

    # -- legal operations ------------------------------------------------------

    @rule(data=st.data(), state=st.sampled_from(ALLOCATED))
    def allocate(self, data: st.DataObject, state: BlockState) -> None:
        n = data.draw(st.integers(0, self.num_free), label="n")
        assert self.alloc.can_allocate(n)
        ids = self.alloc.allocate(n, state)
        assert len(ids) == len(set(ids)) == n
        assert all(b not in self.state and 0 <= b < self.total for b in ids)
        for b in ids:
            self.state[b] = state
            self.refs[b] = 1

    @precondition(lambda self: self.state)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(self.state)), label="block")
        self.alloc.fork([b])
        self.refs[b] += 1

    @precondition(lambda self: self.state)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # A random handful of outstanding references, in random order (a block
        # with two references may be freed twice in one call).
        refs = data.draw(st.permutations(self.references()), label="order")
        k = data.draw(st.integers(1, len(refs)), label="k")
        self.alloc.free(refs[:k])
        for b in refs[:k]:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b], self.state[b]

    @precondition(lambda self: self.state)
    @rule(data=st.data(), new=st.sampled_from([BlockState.USED, BlockState.HELD]))
    def legal_transition(self, data: st.DataObject, new: BlockState) -> None:
        movable = [b for b, s in sorted(self.state.items()) if (s, new) in LEGAL]
        if not movable:
            return
        ids = data.draw(st.lists(st.sampled_from(movable), min_size=1, unique=True))
        self.alloc.transition(ids, new)
        for b in ids:
            self.state[b] = new

    # -- illegal operations ----------------------------------------------------

    @precondition(lambda self: self.state)
    @rule(data=st.data(), new=st.sampled_from(list(BlockState)))
    def illegal_transition(self, data: st.DataObject, new: BlockState) -> None:
        bad = [b for b, s in sorted(self.state.items()) if (s, new) not in LEGAL]
        if not bad:
            return
        b = data.draw(st.sampled_from(bad), label="bad")
        # Legal moves listed with the illegal one must not happen either.
        good = [x for x, s in sorted(self.state.items()) if (s, new) in LEGAL]
        ids = data.draw(st.permutations([b, *good]), label="ids")
        self.expect_error(self.alloc.transition, ids, new)

    @precondition(lambda self: self.num_free)
    @rule(data=st.data())
    def free_of_free_block(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.free_ids()), label="free block")
        self.expect_error(self.alloc.free, [b])
        self.expect_error(self.alloc.fork, [b])
        self.expect_error(self.alloc.transition, [b], BlockState.USED)

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        # Allocate, drop the last reference, then free the stale id again.
        if not self.num_free:
            return
        (b,) = self.alloc.allocate(1)
        self.alloc.free([b])
        self.expect_error(self.alloc.free, [b])

    @rule(extra=st.integers(1, 3), state=st.sampled_from(ALLOCATED))
    def over_allocate(self, extra: int, state: BlockState) -> None:
        assert not self.alloc.can_allocate(self.num_free + extra)
        self.expect_error(self.alloc.allocate, self.num_free + extra, state)

    @rule()
    def refused_arguments(self) -> None:
        assert not self.alloc.can_allocate(-1)
        self.expect_error(self.alloc.allocate, 0, BlockState.FREE)
        self.expect_error(self.alloc.free, [self.total])
        self.expect_error(self.alloc.fork, [-1])

    # -- invariants ------------------------------------------------------------

    @invariant()
    def books_agree(self) -> None:
        self.alloc.check_integrity()
        counts = self.alloc.counts()
        expected = {s.value: 0 for s in BlockState}
        for s in self.state.values():
            expected[s.value] += 1
        expected["free"] = self.num_free
        assert counts == {**expected, "total": self.total}
        assert sum(v for k, v in counts.items() if k != "total") == self.total
        assert self.alloc.num_free == self.num_free
        for b in range(self.total):
            assert self.alloc.state(b) is self.state.get(b, BlockState.FREE)
            assert self.alloc.ref_count(b) == self.refs.get(b, 0)

    def teardown(self) -> None:
        if not self.total:
            return
        self.alloc.free(self.references())
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
    max_examples=150, stateful_step_count=40, deadline=None
)
TestAllocator = AllocatorMachine.TestCase


def test_rejects_nonpositive_size() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_refused_free_or_fork_changes_nothing() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    with pytest.raises(AllocatorError):
        alloc.free([a, 3])  # 3 is free
    with pytest.raises(AllocatorError):
        alloc.fork([b, 3])
    with pytest.raises(AllocatorError):
        alloc.free([b, b, b])  # one reference more than b has
    alloc.check_integrity()
    assert (alloc.ref_count(a), alloc.ref_count(b)) == (1, 1)
