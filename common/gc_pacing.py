"""Garbage collection on a timer instead of on allocation counts, for a process that serves
streams from an event loop (the proxy).

CPython collects its youngest generation every 700 allocations of tracked objects. In the
proxy at 100 new streams/s that is ~25 collections a second, and each one walks every young
object of every live stream (their coroutines, frames, futures: 2,000-5,000 objects, about
1 ms on this machine) while the event loop waits. A 1 ms stall a few percent of the time
is in the p99 of everything the loop serves: measured with `scripts/bench_proxy.py`'s
latency phase, client TTFT p99 3.0-3.3 ms with CPython's collector and 2.0-2.1 ms without
one.

`PacedCollector` freezes what startup made (`gc.freeze`, as `freeze_startup_objects` did),
turns the automatic collector off, and collects from a task every `interval_s` instead:
the youngest generation each time, the middle one every `MIDDLE_EVERY`-th, everything every
`FULL_EVERY`-th. Most of the proxy's garbage is freed by reference counting the moment it
is dropped; what waits for a collection is only what sits in reference cycles, at most
`interval_s` of it. One pause of about the same length now comes a few times a second
instead of 25 times, so it falls out of the p99.

Only a process's own entry point should start one (`pdserve proxy`, `pdserve up`): it
changes the garbage collector of the whole process. `stop` turns the automatic collector
back on.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger(__name__)

MIDDLE_EVERY = 10  # CPython's own ratio between generations (gc.get_threshold()[1:])
FULL_EVERY = 100
SLOW_PAUSE_S = 0.05  # a collection this long is logged
PAUSE_BUCKETS = (0.0001, 0.0003, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class PacedCollector:
    """Collect garbage every `interval_s` from the running event loop (see the module)."""

    def __init__(self, interval_s: float = 0.5, registry: CollectorRegistry | None = None) -> None:
        if not 0 < interval_s <= 60:
            raise ValueError(f"interval_s must be in (0, 60], got {interval_s}")
        self.interval_s = interval_s
        self._pauses: Histogram | None = None
        self._freed: Counter | None = None
        if registry is not None:
            self._pauses = Histogram(
                "pdserve_gc_pause_seconds",
                "Paced garbage collections: how long each stopped the process",
                ["generation"],
                registry=registry,
                buckets=PAUSE_BUCKETS,
            )
            self._freed = Counter(
                "pdserve_gc_collected_objects",
                "Objects the paced garbage collections freed",
                ["generation"],
                registry=registry,
            )
        self.collections = 0
        self.pause_s_max = 0.0
        self._task: asyncio.Task[None] | None = None
        self._was_enabled = True

    def start(self) -> None:
        """Freeze the objects made so far, stop automatic collection, start the timer."""
        if self._task is not None:
            raise RuntimeError("the collector is already running")
        gc.collect()
        gc.freeze()
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="paced-gc")

    async def stop(self) -> None:
        """Stop the timer and give collection back to CPython (if it had it)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        if self._was_enabled:
            gc.enable()

    def collect(self) -> int:
        """One paced collection (the generation the count gives); what it freed."""
        self.collections += 1
        generation = (
            2
            if self.collections % FULL_EVERY == 0
            else 1
            if self.collections % MIDDLE_EVERY == 0
            else 0
        )
        t0 = time.perf_counter()
        freed = gc.collect(generation)
        pause = time.perf_counter() - t0
        self.pause_s_max = max(self.pause_s_max, pause)
        if self._pauses is not None and self._freed is not None:
            self._pauses.labels(str(generation)).observe(pause)
            self._freed.labels(str(generation)).inc(freed)
        if pause > SLOW_PAUSE_S:
            log.warning(
                "garbage collection of generation %d took %.0f ms (freed %d objects)",
                generation, pause * 1e3, freed,
            )  # fmt: skip
        return freed

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.collect()
