"""The one state-machine helper every lifecycle uses: a table of legal moves, checked.

    MOVES = Transitions("sequence", {WAITING: {RUNNING, FINISHED}, RUNNING: {...}, ...})
    self.status = MOVES.move(self.request_id, self.status, new)   # or raises IllegalTransition

A state with no outgoing moves is terminal. Tables are data: tests and docs read them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Generic, TypeVar

S = TypeVar("S", bound=Enum)


class IllegalTransition(RuntimeError):
    """A state change its table does not allow: a bug in the caller, never user input."""


class Transitions(Generic[S]):
    def __init__(self, what: str, table: Mapping[S, Iterable[S]]) -> None:
        self.what = what
        self.table: dict[S, frozenset[S]] = {s: frozenset(n) for s, n in table.items()}

    def allows(self, old: S, new: S) -> bool:
        return new in self.table[old]

    def move(self, name: str, old: S, new: S) -> S:
        """`new` if `old -> new` is legal, else raise IllegalTransition naming both."""
        if new not in self.table[old]:
            raise IllegalTransition(f"{self.what} {name}: illegal {old.value} -> {new.value}")
        return new

    def terminal(self, state: S) -> bool:
        return not self.table[state]
