"""The helpers of scripts/compare_disagg.sh: the mixed workload it writes and the report it
builds from two bench-serve results (their JSON made by bench-serve's own summarize); and
scripts/bench_engine.py's rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch

from common.text.tokenizer import Tokenizer
from proxy.bench.client import RequestResult
from proxy.bench.search import RateSearch, SearchConfig, document
from proxy.bench.stats import Slo, summarize

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_mixed_workload_has_both_kinds_at_exact_lengths(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = tmp_path / "mixed.jsonl"
    argv = ["--out", str(out), "--model", str(tiny_model_dir), "--num-requests", "10"]
    assert _script("mixed_workload").main([*argv, "--long-fraction", "0.3"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    tok = Tokenizer.from_dir(tiny_model_dir)
    lengths = [len(tok.encode(line["prompt"])) for line in lines]
    long = [(n, line["max_tokens"]) for n, line in zip(lengths, lines, strict=True) if n > 500]
    assert len(lines) == 10 and len(long) == 3
    assert all(990 <= n <= 1510 and 9 <= m <= 15 for n, m in long)
    short = [line["max_tokens"] for n, line in zip(lengths, lines, strict=True) if n <= 500]
    assert all(128 <= m <= 192 for m in short)


def _results(gap_s: float) -> list[RequestResult]:
    return [
        RequestResult(
            ok=True,
            start_s=i,
            e2el_s=0.1 + 19 * gap_s,
            requested_output_tokens=20,
            ttft_s=0.1,
            itl_s=[gap_s] * 19,
            output_tokens=20,
            prompt_tokens=50,
        )
        for i in range(10)
    ]


def _config(rate: float) -> dict[str, object]:
    config = {"endpoint": "completions", "dataset": "d.jsonl", "num_requests": 10}
    return config | {"rate": rate, "arrival": "poisson", "seed": 0, "model": "smollm2-135m"}


def _run(run_dir: Path, gap_s: float, slo: Slo) -> None:
    """Ten requests of 20 tokens, the first at 100 ms, then one token every `gap_s`."""
    run_dir.mkdir()
    doc = {"config": _config(1.0), **summarize(_results(gap_s), 10.0, slo)}
    (run_dir / "bench.json").write_text(json.dumps(doc))
    (run_dir / "cdf-rate1.png").write_bytes(b"")


def test_report_has_both_rows_a_verdict_and_the_plots(tmp_path: Path) -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    _run(tmp_path / "colocated", 0.080, slo)  # misses the TPOT SLO
    _run(tmp_path / "disagg", 0.020, slo)
    out = tmp_path / "report.md"
    argv = ["--colocated", str(tmp_path / "colocated"), "--disagg", str(tmp_path / "disagg")]
    assert _script("compare_report").main([*argv, "--out", str(out), "--context", "ctx"]) == 0
    text = out.read_text()
    assert "- ctx" in text and "TTFT <= 1000 ms and TPOT <= 50 ms" in text
    rows = [line for line in text.splitlines() if line.startswith(("| colocated", "| 1P1D"))]
    assert len(rows) == 2 and "0.00 | 0%" in rows[0] and "1.00 | 100%" in rows[1]
    assert "decode ITL p99: **1P1D** (20.0 vs 80.0 ms, 4x lower)" in text
    assert "TTFT p50: tie" in text and "SLO-met req/s: **1P1D**" in text
    assert "- model: `smollm2-135m`" in text and "Goodput (DistServe)" not in text
    assert "](colocated/cdf-rate1.png)" in text and "](disagg/cdf-rate1.png)" in text
    assert (tmp_path / "compare.png").stat().st_size > 0


def _search(run_dir: Path, knee: float, slo: Slo) -> None:
    """A goodput search whose runs slow down past `knee` req/s: TPOT 20 ms below, 80 above."""
    cfg = SearchConfig(start_rate=1.0, min_rate=0.25, max_rate=16.0, max_runs=6)
    search, runs = RateSearch(cfg), []
    while (rate := search.next_rate()) is not None:
        run = {
            "config": _config(rate),
            **summarize(_results(0.02 if rate <= knee else 0.08), 5, slo),
        }
        runs.append(run)
        search.record(rate, run["slo_attainment"])
    config = {k: v for k, v in _config(1.0).items() if k != "rate"}
    doc = document(search.result(), cfg, slo, config, runs)
    (run_dir / "goodput").mkdir()
    (run_dir / "goodput" / "search.json").write_text(json.dumps(doc))


def test_report_states_goodput_distserve_per_deployment(tmp_path: Path) -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    for name, gap, knee in (("colocated", 0.08, 1.5), ("disagg", 0.02, 5.0)):
        _run(tmp_path / name, gap, slo)
        _search(tmp_path / name, knee, slo)
    out = tmp_path / "report.md"
    argv = ["--colocated", str(tmp_path / "colocated"), "--disagg", str(tmp_path / "disagg")]
    assert _script("compare_report").main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Goodput (DistServe)" in text and "Model `smollm2-135m`" in text
    assert "TTFT <= 1000 ms and TPOT <= 50 ms, met by at least 90% of the requests" in text
    rows = [line for line in text.splitlines() if line.startswith(("| colocated", "| 1P1D"))]
    assert rows[2].startswith("| colocated") and "| 1.5 | 1.5 / 1.625 | 5 |" in rows[2]
    assert "1: 100%, 1.5: 100%, 1.625: 0%, 1.75: 0%, 2: 0%" in rows[2]
    assert "| 5 | 5 / 6 | 6 |" in rows[3]
    assert "goodput (DistServe): **1P1D** (5.00 vs 1.50 req/s, 3.3x higher)" in text
    assert "![SLO attainment against the offered rate](goodput.png)" in text
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert "goodput/" not in text.split("## Plots")[1]  # the search's own plots stay out

    verdict = _script("compare_report").verdict("g", "req/s", ("a", "b"), (8.0, 0.0), True)
    assert verdict == "g: **a** (8.00 vs 0.00 req/s, the other is 0)"  # goodput 0: no ratio

    (tmp_path / "disagg" / "goodput" / "search.json").unlink()  # one side only: refused
    assert _script("compare_report").main([*argv, "--out", str(out)]) == 2


def test_bench_engine_times_both_engines_on_every_row(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "engine.json"
    argv = ["--model", str(tiny_model_dir), "--batches", "1,3", "--sampled-batch", "2"]
    argv += ["--prompt-len", "8", "--output-len", "4", "--prefill-len", "32", "--repeats", "2"]
    threads = torch.get_num_threads()
    try:
        _script("bench_engine").main([*argv, "--threads", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script sets the process's torch threads
    data = json.loads(out.read_text())
    assert data["threads"] == 1 and data["dtype"] == "float32"
    rows = data["rows"]
    assert [(r["what"], r["size"]) for r in rows] == [
        ("decode", 1), ("decode", 3), ("sampled", 2), ("prefill", 32)
    ]  # fmt: skip
    for r in rows:
        assert len(r["pdserve_runs"]) == len(r["hf_runs"]) == 2
        assert r["pdserve_tok_s"] > 0 and r["transformers_tok_s"] > 0


def test_compare_routing_report_has_every_deployment_and_the_cache_ratio() -> None:
    cr = _script("compare_routing")
    args = cr.build_parser().parse_args(["--num-requests", "5"])
    rows = [
        {"deployment": name, "ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50, "tpot_p50_ms": 30.0,
         "cache_hit_rate": hit, "kv_bytes_per_request": 3 * 2**20, "disagreeing_decisions": 2.0,
         "completed": 5, "failed": 0}
        for name, p50, hit in (("cost", 100.0, 0.8), ("no-cache", 450.0, None))
    ]  # fmt: skip
    text = cr.report(rows, args)
    assert "| cost | 100 | 200 | 30 | 80% | 3.00 MiB | 2 | 0 |" in text
    assert "| no-cache | 450 | 900 | 30 | - |" in text
    assert "without the prefix cache / with it: 4.50x" in text
    chats = cr.build_parser().parse_args(["--num-requests", "5", "--turns", "3"])
    assert "5 conversations" in cr.report(rows, chats) and "of 3 turns" in cr.report(rows, chats)
    metrics = 'x_total{policy="cost",cache_vs_queue="disagree"} 3.0\nx_total{policy="cost"} 5\n'
    assert cr.sample_sum(metrics, "x_total", cache_vs_queue="disagree") == 3.0
    assert cr.sample_sum(metrics, "x_total") == 8.0


def test_histogram_quantiles_between_two_scrapes_interpolate_within_buckets() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    h = Histogram("step_seconds", "", ["phase"], buckets=(0.01, 0.02, 0.04), registry=registry)
    h.labels("forward").observe(0.5)  # before the run: not counted
    before = generate_latest(registry).decode()
    for v in [0.005] * 50 + [0.015] * 40 + [0.03] * 10:
        h.labels("forward").observe(v)
    h.labels("sample").observe(0.001)  # another label: not counted
    after = generate_latest(registry).decode()
    quantile = _script("up_service").histogram_quantile
    assert quantile(before, after, "step_seconds", 0.5, phase="forward") == (0.01, 100)
    p75, _ = quantile(before, after, "step_seconds", 0.75, phase="forward")
    assert p75 is not None and abs(p75 - 0.01625) < 1e-9  # 25 of the 40 in (0.01, 0.02]
    p99, _ = quantile(before, after, "step_seconds", 0.99, phase="forward")
    assert p99 is not None and abs(p99 - 0.038) < 1e-9
    assert quantile(before, before, "step_seconds", 0.5) == (None, 0.0)
    assert quantile(before, after, "step_seconds", 0.5)[1] == 101  # both labels
