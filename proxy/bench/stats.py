"""bench-serve's numbers: latency distributions, throughput, goodput, error summary.

Percentiles interpolate linearly between samples (numpy's default, as vLLM reports them).
TTFT, TPOT and E2EL have one sample per completed request (TPOT only where it output at
least two tokens); ITL pools every gap of every completed request.

SLO attainment is the fraction of all sent requests that meet every SLO given: a failed
request is a miss, and a request with one output token has no TPOT, so it meets any TPOT
SLO (only its TTFT is judged). The per-run `goodput` is the requests per second that meet
every SLO given (vLLM's measure); it is not DistServe's goodput, the highest rate whose
attainment reaches 90% (`--goodput-search`, search.py). With no SLO given, both are null.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--slo-{name.replace('_', '-')} must be > 0, got {value}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met(self, r: RequestResult) -> bool:
        """Whether `r` meets every SLO given: a failed request never does; one with a single
        output token (no TPOT) meets any TPOT SLO."""
        if not r.ok or r.ttft_s is None:
            return False
        tpot_ms = (r.tpot_s or 0.0) * 1e3
        return (
            (self.ttft_ms is None or r.ttft_s * 1e3 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot_ms <= self.tpot_ms)
            and (self.e2el_ms is None or r.e2el_s * 1e3 <= self.e2el_ms)
        )

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, std, min, p50, p90, p99, max of `values`; all null when there are none."""
    keys = ["mean", "std", "min", *(f"p{p}" for p in PERCENTILES), "max"]
    if not values:
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=np.float64)
    out: dict[str, float | None] = {
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
    }
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    out["max"] = float(a.max())
    return out


def attainment(results: list[RequestResult], slo: Slo) -> float | None:
    """The fraction of `results` (every sent request, failed ones included) that meet every
    SLO given; None with no SLO or no request."""
    if not slo.given or not results:
        return None
    return sum(slo.met(r) for r in results) / len(results)


def samples_ms(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-metric samples in milliseconds, from the completed requests."""
    ok = [r for r in results if r.ok]
    return {
        "ttft_ms": [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None],
        "tpot_ms": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
        "itl_ms": [gap * 1e3 for r in ok for gap in r.itl_s],
        "e2el_ms": [r.e2el_s * 1e3 for r in ok],
    }


def detailed(results: list[RequestResult]) -> list[dict[str, Any]]:
    """One record per request, in send order (`--save-detailed`): where a tail comes from
    (which request, which gap) is lost once the samples are pooled."""

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1e3, 3)

    return [
        {
            "start_ms": ms(r.start_s),
            "ok": r.ok,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "output_tokens": r.output_tokens,
            "ttft_ms": ms(r.ttft_s),
            "e2el_ms": ms(r.e2el_s),
            "itl_ms": [ms(gap) for gap in r.itl_s],
            "error": r.error,
        }
        for r in sorted(results, key=lambda r: r.start_s)
    ]


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


REJECTED = frozenset({"HTTP 429", "HTTP 503"})  # refused before a response started


def summarize(results: list[RequestResult], duration_s: float, slo: Slo) -> dict[str, Any]:
    """Every number of one run (the JSON output less `config`)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    good = sum(slo.met(r) for r in ok) if slo.given else None
    rejected = sum(not r.ok and r.error in REJECTED for r in results)
    summary: dict[str, Any] = {
        "sent": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "rejected": rejected,
        "duration_s": duration_s,
        "request_throughput": _rate(len(ok), duration_s),
        "rejected_throughput": _rate(rejected, duration_s),
        "output_token_throughput": _rate(out_tokens, duration_s),
        "total_token_throughput": _rate(in_tokens + out_tokens, duration_s),
        "total_input_tokens": in_tokens,
        "total_cached_tokens": cached_tokens,
        "cache_hit_rate": cached_tokens / in_tokens if in_tokens else None,
        "total_output_tokens": out_tokens,
        "goodput": None if good is None else _rate(good, duration_s),
        "slo": slo.as_dict(),
        "slo_attainment": attainment(results, slo),
        "output_tokens_source": _token_source(ok),
        "short_outputs": sum(r.output_tokens < r.requested_output_tokens for r in ok),
        "max_concurrent": max_concurrent(results),
        "errors": error_summary(results),
    }
    for name, values in samples_ms(results).items():
        summary[name] = distribution(values)
    return summary


def _token_source(ok: list[RequestResult]) -> str | None:
    """ "usage" when every completed request's count came from the usage chunk, "chunks" when
    none did (one token per text chunk assumed), "mixed" otherwise."""
    reported = {r.usage_reported for r in ok}
    if not reported:
        return None
    if reported == {True}:
        return "usage"
    return "chunks" if reported == {False} else "mixed"


def max_concurrent(results: list[RequestResult]) -> int:
    """The most requests in flight at one time (client side), from send and end times."""
    events = []
    for r in results:
        events += [(r.start_s, 1), (r.start_s + r.e2el_s, -1)]
    peak = level = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts at a tie
        level += step
        peak = max(peak, level)
    return peak


def error_summary(results: list[RequestResult]) -> dict[str, Any]:
    """Failures by kind, with the first message seen for each kind."""
    kinds: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for r in results:
        if not r.ok:
            kind = r.error or "unknown"
            kinds[kind] += 1
            examples.setdefault(kind, r.detail or "")
    return {"total": sum(kinds.values()), "by_kind": dict(kinds), "examples": examples}
