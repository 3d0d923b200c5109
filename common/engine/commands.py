"""What other threads ask of the engine thread: commands queued on `LLMEngine`'s inbox and
applied, in order, at the start of the next step (`LLMEngine.apply_commands`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.engine.sequence import Sequence


@dataclass(frozen=True)
class AddRequest:
    seq: Sequence
    transfer: object | None = None  # the node's record of the request's transfer, if any


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    choice: int | None = None  # n > 1: that choice only


@dataclass(frozen=True)
class ReleaseHeldKV:
    request_id: str


@dataclass(frozen=True)
class AdmitLanded:
    seq: Sequence


@dataclass(frozen=True)
class CallOnEngine:
    fn: Callable[[], object]
    done: Callable[[object, BaseException | None], None]

    def run(self) -> None:
        """On the engine thread: `fn`, its outcome handed to `done` (an error too)."""
        try:
            result = self.fn()
        except Exception as e:  # the caller's error, handed back to it
            self.done(None, e)
            return
        self.done(result, None)


EngineCommand = AddRequest | AbortRequest | ReleaseHeldKV | AdmitLanded | CallOnEngine
