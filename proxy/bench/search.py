"""Goodput the way DistServe defines it: the highest request rate at which at least
`threshold` (0.9) of the requests meet both the TTFT and the TPOT objective.

The rate is found by a bounded search over runs of the same seeded workload. `RateSearch`
holds only the decisions (which rate next, when to stop); whoever drives it runs the load
and reports each run's attainment, so the logic is testable with a fake "rate -> attainment":

    search = RateSearch(SearchConfig(start_rate=1.0, ...))
    while (rate := search.next_rate()) is not None:
        search.record(rate, attainment_of_a_run_at(rate))
    search.result().goodput_rps

1. Bracket: run at `start_rate`. While every run passed, double (up to `max_rate`); while
   every run failed, halve (down to `min_rate`).
2. Bisect between the highest passing and the lowest failing rate until
   `lowest_failing / highest_passing - 1 <= tolerance`.
Never more than `max_runs` runs; rates are rounded to 4 significant digits (a bound given
with more is used as given).

Every passing rate probed lies below every failing one (doubling stops at the first failure,
halving at the first pass, a bisection probe only narrows the bracket), so the result, the
highest passing rate, is also the lower end of the last bracket. Attainment is assumed to
fall as the rate rises; where noise breaks that (a run passes above a rate that failed),
the search never probes there: it reports the crossing it found first, which is the
conservative answer, and the curve shows every run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from proxy.bench.stats import Slo

SCHEMA = "pdserve.bench_serve.goodput_search.v1"
SIG_DIGITS = 4
EPSILON = 1e-9


class StopReason(str, Enum):
    CONVERGED = "converged"  # the bracket is within the tolerance
    MAX_RUNS = "max_runs"  # the run budget was spent first
    MAX_RATE = "max_rate"  # passed at max_rate: goodput is at least that
    MIN_RATE = "min_rate"  # failed at min_rate: goodput is below it (reported as 0)


@dataclass(frozen=True)
class SearchConfig:
    start_rate: float
    min_rate: float
    max_rate: float
    max_runs: int = 8
    tolerance: float = 0.1
    threshold: float = 0.9

    def __post_init__(self) -> None:
        if not (0 < self.start_rate and math.isfinite(self.start_rate)):
            raise ValueError(f"the search's --rate must be finite and > 0, got {self.start_rate}")
        if not 0 < self.min_rate <= self.start_rate <= self.max_rate < math.inf:
            raise ValueError(
                "need 0 < --search-min-rate <= --rate <= --search-max-rate < inf, got "
                f"{self.min_rate:g}, {self.start_rate:g}, {self.max_rate:g}"
            )
        if self.max_runs < 1:
            raise ValueError(f"--max-search-runs must be >= 1, got {self.max_runs}")
        if not 0 < self.tolerance:
            raise ValueError(f"--search-tolerance must be > 0, got {self.tolerance}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"--goodput-attainment must be in (0, 1], got {self.threshold}")


@dataclass(frozen=True)
class Probe:
    rate: float
    attainment: float
    passed: bool


@dataclass(frozen=True)
class SearchResult:
    goodput_rps: float  # the highest passing rate; 0.0 when no run passed
    highest_passing_rate: float | None
    lowest_failing_rate: float | None
    stop_reason: StopReason
    probes: tuple[Probe, ...]  # in the order they ran

    def note(self, threshold: float) -> str:
        """One sentence on what the number means and how far to trust it."""
        lo, hi = self.highest_passing_rate, self.lowest_failing_rate
        share = f"{threshold:.0%}"
        if lo is None:
            return (
                f"no rate passed: even the lowest tried, {_fmt(hi)} req/s, had under {share} "
                "of requests within both objectives; goodput is below it (reported as 0)"
            )
        if hi is None:
            why = "the max rate" if self.stop_reason is StopReason.MAX_RATE else "the run budget"
            return (
                f"every run passed up to {_fmt(lo)} req/s, where {why} stopped the search: "
                "goodput is at least this"
            )
        bracket = f"between {_fmt(lo)} (passed) and {_fmt(hi)} req/s (failed)"
        if self.stop_reason is StopReason.CONVERGED:
            return f"goodput lies {bracket}, within the tolerance"
        return f"goodput lies {bracket}; the run budget ended the bisection"


def _fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:g}"


def round_rate(rate: float) -> float:
    """`rate` to SIG_DIGITS significant digits (tidy labels and file names)."""
    return float(f"{rate:.{SIG_DIGITS}g}")


class RateSearch:
    """The decisions of one goodput search. `next_rate()` is a query (None: done);
    `record(rate, attainment)` takes the result of a run at exactly that rate."""

    def __init__(self, cfg: SearchConfig) -> None:
        self.cfg = cfg
        self.probes: list[Probe] = []
        self._next: float | None = self._tidy(cfg.start_rate)
        self._stop: StopReason | None = None

    @property
    def highest_passing(self) -> float | None:
        return max((p.rate for p in self.probes if p.passed), default=None)

    @property
    def lowest_failing(self) -> float | None:
        return min((p.rate for p in self.probes if not p.passed), default=None)

    def _tidy(self, rate: float) -> float:
        """Rounded, but never outside the bounds (a bound is then used as given)."""
        return min(max(round_rate(rate), self.cfg.min_rate), self.cfg.max_rate)

    def next_rate(self) -> float | None:
        return self._next

    def record(self, rate: float, attainment: float) -> None:
        if self._next is None or rate != self._next:
            raise ValueError(f"expected a run at {self._next}, got one at {rate}")
        if not 0.0 <= attainment <= 1.0:
            raise ValueError(f"attainment must be in [0, 1], got {attainment}")
        passed = attainment >= self.cfg.threshold - EPSILON  # 63/70 is 0.9 to a float's ulp
        self.probes.append(Probe(rate, attainment, passed))
        self._next, self._stop = self._decide()

    def _decide(self) -> tuple[float | None, StopReason | None]:
        lo, hi, cfg = self.highest_passing, self.lowest_failing, self.cfg
        assert lo is None or hi is None or lo < hi, "a passing rate above a failing one"
        if lo is not None and hi is not None:
            mid = round_rate((lo + hi) / 2)
            if hi / lo - 1 <= cfg.tolerance or not lo < mid < hi:
                return None, StopReason.CONVERGED
            nxt = mid
        elif hi is None:  # every run passed
            assert lo is not None
            if lo >= cfg.max_rate:
                return None, StopReason.MAX_RATE
            nxt = self._tidy(2 * lo)
            if nxt <= lo:  # max_rate within rounding of lo
                return None, StopReason.MAX_RATE
        else:  # every run failed
            if hi <= cfg.min_rate:
                return None, StopReason.MIN_RATE
            nxt = self._tidy(hi / 2)
            if nxt >= hi:
                return None, StopReason.MIN_RATE
        if len(self.probes) >= cfg.max_runs:
            return None, StopReason.MAX_RUNS
        return nxt, None

    def result(self) -> SearchResult:
        if self._stop is None:
            raise ValueError("the search has not finished")
        lo = self.highest_passing
        return SearchResult(
            goodput_rps=lo if lo is not None else 0.0,
            highest_passing_rate=lo,
            lowest_failing_rate=self.lowest_failing,
            stop_reason=self._stop,
            probes=tuple(self.probes),
        )


def definition(slo: Slo, threshold: float) -> str:
    return (
        f"goodput (DistServe): the highest request rate at which at least {threshold:.0%} of "
        f"the requests meet both TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms "
        "(a failed request is a miss; one with a single output token has no TPOT and is "
        "judged on its TTFT alone)"
    )


def curve(result: SearchResult, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run, by rate: its attainment, pass or fail, and TTFT/TPOT p50/p99."""
    rows = []
    for probe, run in zip(result.probes, runs, strict=True):
        ttft, tpot = run["ttft_ms"], run["tpot_ms"]
        rows.append(
            {
                "rate": probe.rate,
                "attainment": probe.attainment,
                "passed": probe.passed,
                "sent": run["sent"],
                "completed": run["completed"],
                "ttft_p50_ms": ttft["p50"],
                "ttft_p99_ms": ttft["p99"],
                "tpot_p50_ms": tpot["p50"],
                "tpot_p99_ms": tpot["p99"],
                "request_throughput": run["request_throughput"],
                "goodput_per_run": run["goodput"],
            }
        )
    return sorted(rows, key=lambda row: row["rate"])


def document(
    result: SearchResult,
    cfg: SearchConfig,
    slo: Slo,
    config: dict[str, Any],
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    """The search's JSON: the answer, how it was searched, the curve and every run behind it
    (each a full bench-serve run document, in the order they ran)."""
    return {
        "schema": SCHEMA,
        "definition": definition(slo, cfg.threshold),
        "goodput_distserve_rps": result.goodput_rps,
        "highest_passing_rate": result.highest_passing_rate,
        "lowest_failing_rate": result.lowest_failing_rate,
        "stop_reason": result.stop_reason.value,
        "note": result.note(cfg.threshold),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "attainment_threshold": cfg.threshold,
        "search": {
            "start_rate": cfg.start_rate,
            "min_rate": cfg.min_rate,
            "max_rate": cfg.max_rate,
            "max_runs": cfg.max_runs,
            "tolerance": cfg.tolerance,
            "runs_used": len(result.probes),
        },
        "config": config,
        "curve": curve(result, runs),
        "runs": runs,
    }
