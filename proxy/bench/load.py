"""bench-serve's load loop: when each request is sent, how many run at once, when it stops.

Arrivals follow a schedule fixed in advance from the seed: Poisson (exponential gaps with
mean 1/rate), fixed (gaps of exactly 1/rate), or all at once (rate inf). A concurrency cap
holds a request back until a slot frees; its scheduled time does not move, so a backlog is
sent as soon as slots free up (as vLLM's benchmark does). Latencies are timed from the
actual send.

The loop is bounded: it stops sending after `num_requests` or once `duration_s` has passed
(whichever first), then waits at most `drain_timeout_s` for the requests in flight and
cancels the rest, which count as failed ("drain timeout"). So `sent == completed + failed`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO, TypeVar

from proxy.bench.client import RequestResult

T = TypeVar("T")
ARRIVALS = ("poisson", "fixed")


@dataclass(frozen=True)
class LoadConfig:
    rate: float = math.inf  # requests per second; inf: all at once
    arrival: str = "poisson"
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0 (or inf), got {self.rate}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"--arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--duration-s must be > 0")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration-s (or both)")
        if self.num_requests is None and math.isinf(self.rate) and self.max_concurrency is None:
            raise ValueError("--rate inf with only --duration-s needs --max-concurrency")
        if not self.drain_timeout_s > 0:
            raise ValueError("--drain-timeout-s must be > 0")


def arrival_offsets(rate: float, arrival: str, rng: random.Random) -> Iterator[float]:
    """Send times, seconds after the start: 0 first, then cumulative gaps."""
    t = 0.0
    while True:
        yield t
        if not math.isinf(rate):
            t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate


@dataclass
class LoadOutcome:
    results: list[RequestResult]
    duration_s: float  # first send to the end of the drain (at least duration_s if cut by it)

    @property
    def sent(self) -> int:
        return len(self.results)


class Progress:
    """A one-line progress bar on stderr: redrawn in place on a terminal, otherwise a line
    every `quiet_interval_s`."""

    def __init__(
        self, cfg: LoadConfig, label: str, stream: IO[str] | None = None, enabled: bool = True
    ) -> None:
        self.cfg, self.label, self.enabled = cfg, label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.sent = self.done = self.failed = 0
        self.start = time.perf_counter()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        fractions = []
        if self.cfg.num_requests:
            fractions.append(self.done / self.cfg.num_requests)
        if self.cfg.duration_s:
            fractions.append(min(1.0, elapsed / self.cfg.duration_s))
        frac = max(fractions, default=0.0)
        bar = "#" * int(frac * 30)
        total = f"/{self.cfg.num_requests}" if self.cfg.num_requests else ""
        return (
            f"{self.label} [{bar:<30}] {self.done}{total} done, {self.failed} failed, "
            f"{self.sent - self.done} in flight, {elapsed:.1f} s"
        )

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    async def ticker(self) -> None:
        interval = 0.2 if self.tty else 5.0
        while True:
            await asyncio.sleep(interval)
            self.draw()


Sent = RequestResult | list[RequestResult]  # one request, or a conversation's turns


async def run_load(
    cfg: LoadConfig,
    items: Iterator[T],
    send: Callable[[T, float], Awaitable[Sent]],
    arrival_seed: int,
    progress: Progress,
) -> LoadOutcome:
    """Send `items` on the schedule; `send(item, run_start)` runs one request (or one
    conversation: its turns, in order) and must return its results (failures included)
    rather than raise. Counts and the concurrency cap are per item."""
    offsets = arrival_offsets(cfg.rate, cfg.arrival, random.Random(arrival_seed))
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    start = time.perf_counter()
    deadline = start + cfg.duration_s if cfg.duration_s else math.inf
    tasks: list[tuple[asyncio.Task[Sent], float]] = []
    progress.start = start
    ticker = asyncio.ensure_future(progress.ticker())

    def finished(task: asyncio.Task[Sent]) -> None:
        if slots is not None:
            slots.release()
        progress.done += 1
        if task.cancelled() or task.exception() is not None:
            progress.failed += 1
        elif not all(r.ok for r in _flat(task.result())):
            progress.failed += 1

    timed_out = False  # stopped sending at the deadline rather than after num_requests
    try:
        sends = zip(itertools.islice(items, cfg.num_requests), offsets, strict=False)  # endless
        for item, offset in sends:
            if start + offset >= deadline:
                timed_out = True
                break
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if slots is not None and not await _acquire_before(slots, deadline):
                timed_out = True
                break
            task = asyncio.ensure_future(send(item, start))
            task.add_done_callback(finished)
            tasks.append((task, time.perf_counter() - start))
            progress.sent += 1
        results = await _drain(tasks, cfg.drain_timeout_s)
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        for task, _ in tasks:  # only if we were cancelled ourselves
            task.cancel()
        await asyncio.gather(*(t for t, _ in tasks), return_exceptions=True)
    progress.draw(final=True)
    elapsed = time.perf_counter() - start
    # A run cut by the deadline was offered load for all of duration_s, even if its last
    # request ended before (the next arrival fell past the deadline): rates divide by that.
    if timed_out and cfg.duration_s is not None:
        elapsed = max(elapsed, cfg.duration_s)
    return LoadOutcome(results, elapsed)


async def _acquire_before(slots: asyncio.Semaphore, deadline: float) -> bool:
    """Take a concurrency slot, giving up at `deadline` (none: a slot comes back when a
    request ends, and every request ends within its own timeouts)."""
    if math.isinf(deadline):
        await slots.acquire()
        return True
    try:
        await asyncio.wait_for(slots.acquire(), max(0.0, deadline - time.perf_counter()))
    except asyncio.TimeoutError:
        return False
    return True


def _flat(sent: Sent) -> list[RequestResult]:
    return sent if isinstance(sent, list) else [sent]


async def _drain(
    tasks: list[tuple[asyncio.Task[Sent], float]], timeout_s: float
) -> list[RequestResult]:
    """Wait up to `timeout_s` for every request; the ones still running are cancelled and
    count as failed. An exception out of `send` (a bug) counts as a failure too, so every
    sent request has exactly one result."""
    pending = [t for t, _ in tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)
    for task, _ in tasks:
        task.cancel()  # no-op for the finished ones
    await asyncio.gather(*(t for t, _ in tasks), return_exceptions=True)
    results = []
    for task, start_s in tasks:
        if task.cancelled():
            results.append(_failed(start_s, "drain timeout", f"still running after {timeout_s} s"))
        elif (exc := task.exception()) is not None:
            results.append(_failed(start_s, f"client bug: {type(exc).__name__}", str(exc)))
        else:
            results.extend(_flat(task.result()))
    return results


def _failed(start_s: float, kind: str, detail: str) -> RequestResult:
    return RequestResult(
        ok=False, start_s=start_s, e2el_s=0.0, requested_output_tokens=0, error=kind, detail=detail
    )
