"""The goodput search (DistServe's goodput: the highest rate at which >= 90% of requests meet
both the TTFT and the TPOT SLO) without a server: the search's decisions against fake
"rate -> attainment" functions, the attainment of a run's requests, the flags, and the whole
CLI path against a port where nothing listens (every run fails: goodput 0)."""

from __future__ import annotations

import json
import math
import random
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.bench.client import RequestResult
from proxy.bench.config import config_from_args
from proxy.bench.main import build_parser, main
from proxy.bench.report import plot_attainment, search_table
from proxy.bench.search import (
    RateSearch,
    SearchConfig,
    SearchResult,
    StopReason,
    curve,
    document,
)
from proxy.bench.stats import Slo, attainment, summarize

Attainment = Callable[[float], float]


def _search(cfg: SearchConfig, attainment_at: Attainment) -> SearchResult:
    search = RateSearch(cfg)
    while (rate := search.next_rate()) is not None:
        search.record(rate, attainment_at(rate))
    return search.result()


def _cfg(
    start_rate: float = 1.0,
    min_rate: float = 1 / 64,
    max_rate: float = 64.0,
    max_runs: int = 8,
    tolerance: float = 0.1,
    threshold: float = 0.9,
) -> SearchConfig:
    return SearchConfig(start_rate, min_rate, max_rate, max_runs, tolerance, threshold)


def _check_invariants(cfg: SearchConfig, result: SearchResult) -> None:
    """What holds for any attainment function, noisy or not."""
    rates = [p.rate for p in result.probes]
    assert 1 <= len(rates) <= cfg.max_runs
    assert len(set(rates)) == len(rates)  # no rate is run twice
    assert all(cfg.min_rate <= r <= cfg.max_rate for r in rates)
    passing = [p.rate for p in result.probes if p.passed]
    failing = [p.rate for p in result.probes if not p.passed]
    assert max(passing, default=0.0) < min(failing, default=math.inf)
    assert result.goodput_rps == max(passing, default=0.0)
    assert result.highest_passing_rate == max(passing, default=None)
    assert result.lowest_failing_rate == min(failing, default=None)
    for p in result.probes:
        assert p.passed == (p.attainment >= cfg.threshold)
    if result.stop_reason is StopReason.CONVERGED:
        assert result.highest_passing_rate and result.lowest_failing_rate
        assert result.lowest_failing_rate / result.highest_passing_rate - 1 <= cfg.tolerance


def test_a_step_doubles_up_then_bisects_to_the_tolerance() -> None:
    cfg = _cfg()
    result = _search(cfg, lambda r: 1.0 if r <= 3.3 else 0.5)
    assert [p.rate for p in result.probes] == [1, 2, 4, 3, 3.5, 3.25]
    assert result.stop_reason is StopReason.CONVERGED
    assert result.goodput_rps == 3.25 and result.lowest_failing_rate == 3.5
    _check_invariants(cfg, result)


def test_a_smooth_curve_is_bracketed_around_its_crossing() -> None:
    cfg = _cfg(start_rate=0.5, tolerance=0.05, max_runs=12)
    crossing = math.sqrt(10)  # 1 - (r / 10)**2 = 0.9
    result = _search(cfg, lambda r: max(0.0, 1 - (r / 10) ** 2))
    _check_invariants(cfg, result)
    assert result.stop_reason is StopReason.CONVERGED
    assert result.highest_passing_rate is not None and result.lowest_failing_rate is not None
    assert result.highest_passing_rate <= crossing < result.lowest_failing_rate


def test_a_failing_start_halves_down_to_a_pass() -> None:
    cfg = _cfg(start_rate=4.0)
    result = _search(cfg, lambda r: 0.95 if r <= 0.3 else 0.2)
    assert [p.rate for p in result.probes][:5] == [4, 2, 1, 0.5, 0.25]
    assert 0.25 <= result.goodput_rps <= 0.3
    _check_invariants(cfg, result)


def test_nothing_passing_is_goodput_zero_and_says_so() -> None:
    cfg = _cfg(start_rate=2.0, min_rate=0.5)
    result = _search(cfg, lambda r: 0.0)
    assert [p.rate for p in result.probes] == [2, 1, 0.5]
    assert result.stop_reason is StopReason.MIN_RATE
    assert result.goodput_rps == 0.0 and result.highest_passing_rate is None
    assert "no rate passed" in result.note(cfg.threshold)
    _check_invariants(cfg, result)


def test_everything_passing_stops_at_the_max_rate() -> None:
    cfg = _cfg(max_rate=5.0)
    result = _search(cfg, lambda r: 1.0)
    assert [p.rate for p in result.probes] == [1, 2, 4, 5]  # never past the max
    assert result.stop_reason is StopReason.MAX_RATE and result.goodput_rps == 5.0
    assert "at least" in result.note(cfg.threshold)


def test_the_run_budget_is_never_exceeded() -> None:
    for runs in range(1, 6):
        cfg = _cfg(max_runs=runs, tolerance=0.001)
        result = _search(cfg, lambda r: 1.0 if r <= 3.3 else 0.0)
        assert len(result.probes) == runs
        assert result.stop_reason is StopReason.MAX_RUNS
        _check_invariants(cfg, result)
    one = _search(_cfg(max_runs=1), lambda r: 1.0)
    assert one.goodput_rps == 1.0 and "run budget" in one.note(0.9)


def test_a_non_monotone_curve_reports_the_first_crossing_it_finds() -> None:
    """Passes below 1.5 and again between 3 and 6 (noise, or a server that batches better
    under more load): the search stops at the first crossing and never probes above it."""
    cfg = _cfg()
    result = _search(cfg, lambda r: 0.95 if r < 1.5 or 3 < r < 6 else 0.5)
    _check_invariants(cfg, result)
    assert 1.0 <= result.goodput_rps < 1.5
    assert max(p.rate for p in result.probes) == 2.0


def test_noisy_curves_keep_every_bound() -> None:
    rng = random.Random(7)
    for _ in range(300):
        knee = rng.uniform(0.01, 100)
        noise = rng.uniform(0, 0.3)
        start = rng.choice([0.1, 0.123456, 1.0, 3.7, 20.0])
        cfg = _cfg(
            start_rate=start,
            min_rate=start / rng.choice([1, 4, 64]),
            max_rate=start * rng.choice([1, 4, 64]),
            max_runs=rng.randint(1, 12),
            tolerance=rng.choice([0.01, 0.1, 0.5]),
            threshold=rng.choice([0.5, 0.9, 0.99]),
        )
        draws = random.Random(rng.random())

        def noisy(
            r: float, knee: float = knee, noise: float = noise, draws: random.Random = draws
        ) -> float:
            base = 1.0 if r <= knee else max(0.0, 1 - (r - knee) / knee)
            return min(1.0, max(0.0, base + draws.uniform(-noise, noise)))

        _check_invariants(cfg, _search(cfg, noisy))


def test_an_attainment_of_exactly_the_threshold_passes() -> None:
    search = RateSearch(_cfg())
    search.record(1.0, 63 / 70)
    assert search.probes[0].passed


def test_the_search_refuses_misuse() -> None:
    search = RateSearch(_cfg())
    with pytest.raises(ValueError, match="expected a run at 1"):
        search.record(2.0, 1.0)
    with pytest.raises(ValueError, match="attainment"):
        search.record(1.0, 1.5)
    with pytest.raises(ValueError, match="not finished"):
        search.result()
    for bad in (
        {"start_rate": math.inf},
        {"min_rate": 2.0},
        {"max_rate": 0.5},
        {"max_runs": 0},
        {"tolerance": 0.0},
        {"threshold": 1.5},
    ):
        with pytest.raises(ValueError):
            _cfg(**bad)


# -- attainment of a run -----------------------------------------------------------------------


def _ok(ttft: float, e2el: float, tokens: int) -> RequestResult:
    return RequestResult(
        ok=True, start_s=0.0, e2el_s=e2el, requested_output_tokens=tokens, ttft_s=ttft,
        output_tokens=tokens, usage_reported=True,
    )  # fmt: skip


def test_attainment_is_over_every_sent_request_and_needs_both_slos() -> None:
    slo = Slo(ttft_ms=100, tpot_ms=50)
    results = [
        _ok(0.05, 0.05 + 9 * 0.04, 10),  # ttft 50 ms, tpot 40 ms: met
        _ok(0.05, 0.05 + 9 * 0.06, 10),  # tpot 60 ms: missed
        _ok(0.15, 0.15 + 9 * 0.01, 10),  # ttft 150 ms: missed
        _ok(0.05, 0.05, 1),  # one token: no TPOT, judged on TTFT alone: met
        _ok(0.20, 0.20, 1),  # one token, TTFT missed
        RequestResult(ok=False, start_s=0, e2el_s=0.1, requested_output_tokens=10, error="x"),
    ]
    assert attainment(results, slo) == pytest.approx(2 / 6)  # the failure is a miss
    assert summarize(results, 1.0, slo)["slo_attainment"] == pytest.approx(2 / 6)
    assert attainment(results, Slo()) is None
    assert attainment([], slo) is None


# -- flags ---------------------------------------------------------------------------------------


def _config(*argv: str) -> object:
    return config_from_args(build_parser().parse_args(["--model", "m", *argv]))


def test_search_flags_need_both_slos_and_one_finite_start_rate() -> None:
    slos = ("--slo-ttft-ms", "100", "--slo-tpot-ms", "50")
    cfg = config_from_args(build_parser().parse_args(["--goodput-search", *slos]))
    assert cfg.search is not None and cfg.rates == (1.0,)
    assert (cfg.search.min_rate, cfg.search.max_rate) == (1 / 64, 64.0)
    assert (cfg.search.threshold, cfg.search.max_runs, cfg.search.tolerance) == (0.9, 8, 0.1)
    started = config_from_args(
        build_parser().parse_args(["--goodput-search", *slos, "--rate", "3"])
    )
    assert started.rates == (3.0,) and started.search is not None
    assert started.search.start_rate == 3.0
    assert config_from_args(build_parser().parse_args([])).rates == (math.inf,)
    for bad, match in (
        (["--slo-ttft-ms", "100"], "--slo-tpot-ms"),
        ([*slos, "--slo-e2el-ms", "9"], "drop --slo-e2el-ms"),
        ([*slos, "--rate", "1", "2"], "one finite --rate"),
        ([*slos, "--rate", "inf"], "one finite --rate"),
        ([*slos, "--goodput-attainment", "0"], "--goodput-attainment"),
        ([*slos, "--rate", "2", "--search-max-rate", "1"], "--search-max-rate"),
    ):
        with pytest.raises(ValueError, match=match):
            _config("--goodput-search", *bad)


# -- the answer's shape ------------------------------------------------------------------------


def _run_doc(rate: float, att: float) -> dict[str, object]:
    dist = {"p50": 10.0 * rate, "p99": 20.0 * rate}
    return {
        "config": {"rate": rate}, "sent": 10, "completed": 10, "slo_attainment": att,
        "ttft_ms": dist, "tpot_ms": dist, "request_throughput": rate, "goodput": att * rate,
    }  # fmt: skip


def test_document_table_and_plot_carry_the_curve(tmp_path: Path) -> None:
    cfg, slo = _cfg(max_rate=4.0), Slo(ttft_ms=100, tpot_ms=50)
    search = RateSearch(cfg)
    runs = []
    while (rate := search.next_rate()) is not None:
        att = 1.0 if rate < 3 else 0.5
        runs.append(_run_doc(rate, att))
        search.record(rate, att)
    result = search.result()
    doc = document(result, cfg, slo, {"model": "m"}, runs)
    assert doc["goodput_distserve_rps"] == result.goodput_rps == 2.75  # 1 2 4 3 2.5 2.75
    assert doc["runs"] == runs  # in the order run
    assert [row["rate"] for row in doc["curve"]] == sorted(p.rate for p in result.probes)
    assert [row["rate"] for row in curve(result, runs)] == [1, 2, 2.5, 2.75, 3, 4]
    assert doc["slo"] == {"ttft_ms": 100, "tpot_ms": 50} and doc["attainment_threshold"] == 0.9
    assert "TTFT <= 100 ms and TPOT <= 50 ms" in doc["definition"]
    assert doc["search"]["runs_used"] == 6 and doc["stop_reason"] == "converged"
    json.dumps(doc)  # JSON as it stands
    table = search_table(doc)
    assert "Goodput (DistServe): 2.75 req/s" in table and ">= 90% of requests" in table
    plot_attainment(doc, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_search_where_nothing_listens_halves_to_the_min_rate(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    out = tmp_path / "search.json"
    argv = ["--base-url", url, "--model", "m", "--num-requests", "2", "--no-progress"]
    argv += ["--goodput-search", "--slo-ttft-ms", "100", "--slo-tpot-ms", "50"]
    argv += ["--rate", "40", "--search-min-rate", "10", "--request-timeout-s", "5"]
    argv += ["--json", str(out), "--plot-dir", str(tmp_path)]
    assert main(argv) == 1  # ran, but no run completed a request
    doc = json.loads(out.read_text())
    assert doc["goodput_distserve_rps"] == 0.0 and doc["stop_reason"] == "min_rate"
    assert [row["rate"] for row in doc["curve"]] == [10, 20, 40]
    assert [run["config"]["rate"] for run in doc["runs"]] == [40, 20, 10]
    assert all(row["attainment"] == 0.0 and not row["passed"] for row in doc["curve"])
    assert (tmp_path / "attainment_vs_rate.png").stat().st_size > 0
