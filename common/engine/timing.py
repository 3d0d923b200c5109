"""Where one engine step's time went: `StepTiming`, reported to `LLMEngine.on_step` (the
node's step-time histograms in /metrics, split into admit / schedule / forward / sample /
output)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from common.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class StepTiming:
    """Where one engine step's time went (seconds, wall clock on the engine thread).

    On a GPU the forward is launched asynchronously and waited for when the sampled tokens
    are read back, so there `forward_s` is mostly launch time and `sample_s` holds the wait.
    """

    admit_s: float  # commands applied: new requests, landed KV admitted, aborts, releases
    schedule_s: float
    forward_s: float  # inputs built, model run, logits
    sample_s: float
    output_s: float  # outputs made, records updated, state published
    num_decode: int  # sequences in the batch that decode one token
    num_prefill_tokens: int

    @property
    def total_s(self) -> float:
        return self.admit_s + self.schedule_s + self.forward_s + self.sample_s + self.output_s

    @property
    def kind(self) -> str:
        """decode (decode tokens only), prefill (prompt chunks only) or mixed."""
        if not self.num_prefill_tokens:
            return "decode"
        return "mixed" if self.num_decode else "prefill"

    @classmethod
    def of(cls, batch: ScheduledBatch, stamps: tuple[float, ...], sample_s: float) -> StepTiming:
        """The timing of a step that ran `batch`, from its stamps (started, commands applied,
        scheduled, forward done; its outputs end now) and the runner's sampling time."""
        t0, t1, t2, t3 = stamps
        return cls(
            admit_s=t1 - t0,
            schedule_s=t2 - t1,
            forward_s=t3 - t2 - sample_s,
            sample_s=sample_s,
            output_s=time.perf_counter() - t3,
            num_decode=batch.num_decode,
            num_prefill_tokens=batch.num_tokens - batch.num_decode,
        )


def prefill_rate(old: float | None, prefill_tokens: int, seconds: float) -> float | None:
    """Prefill speed, tokens a second, averaged over the steps that were mostly prefill
    (`old`, then this step's): what a router divides queued prompt tokens by to estimate
    a wait."""
    if prefill_tokens < 16 or seconds <= 0:
        return old
    rate = prefill_tokens / seconds
    return rate if old is None else 0.8 * old + 0.2 * rate


class SlowestRecent:
    """The slowest step of the last `window_s` seconds (a sliding-window maximum, amortized
    O(1) a step): what a proxy waits well beyond before it calls a silent stream stalled.
    The window is in seconds, not steps: a long prefill chunk must not drop out of it after
    a burst of fast decode steps (64 of them, ~6 s, was the old window; the next long chunk
    then outlasted the proxy's stall timeout and ended every stream it held up)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._steps: deque[tuple[float, float]] = deque()  # (when, seconds), seconds falling

    def add(self, seconds: float) -> None:
        now = self._clock()
        while self._steps and self._steps[-1][1] <= seconds:
            self._steps.pop()  # never the maximum again: this one is as slow and newer
        self._steps.append((now, seconds))
        self._expire(now)

    def max(self) -> float | None:
        self._expire(self._clock())
        return self._steps[0][1] if self._steps else None

    def _expire(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()


def step_time_bound(
    slowest: float | None, chunk_tokens: int, prefill_tokens_per_s: float | None
) -> float | None:
    """How long a step may take on a node (its `step_time_max_s`, which a proxy waits 4x
    beyond before it calls a silent stream stalled): its slowest recent step, or, if longer,
    a full prefill chunk of `chunk_tokens` at its measured prefill rate, which a node that
    has prefilled can take on the next long prompt even after minutes of decode steps."""
    if not prefill_tokens_per_s:
        return slowest
    chunk = chunk_tokens / prefill_tokens_per_s
    return chunk if slowest is None else max(slowest, chunk)
