"""`pdserve bench-serve` as a user runs it (a subprocess of the CLI) against `pdserve up`
(a proxy with a prefill and a decode node) on loopback."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.main import main
from tests.support import procs
from tests.support.cluster import Service
from tests.support.http import http_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
REQUIRED = (
    "sent",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_token_throughput",
    "goodput",
    "config",
    "errors",
    *LATENCIES,
)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Service]:
    with Service(tiny_model_dir, "--num-blocks", "256") as service:
        yield service


def _bench(cluster: Service, *args: str) -> subprocess.CompletedProcess[str]:
    argv = procs.module("common.cli", "bench-serve", "--base-url", cluster.url, *args)
    return procs.run(argv, timeout=120)


def _check_plausible(
    doc: dict[str, Any], requests: int, output_len: int, gaps_may_merge: bool = False
) -> None:
    """`gaps_may_merge`: runs so short (a few requests of a few tiny-model tokens) that a
    decode node may stream every answer whole before the proxy reads its first line; the
    proxy then relays it as one event (it merges lines that waited), and the run has no
    inter-token gap to measure."""
    assert set(REQUIRED) <= set(doc)
    assert doc["sent"] == requests
    assert doc["completed"] + doc["failed"] == doc["sent"]
    assert doc["completed"] == requests, doc["errors"]
    # ignore_eos + max_tokens: exactly output_len tokens each, counted by the usage chunk.
    assert doc["output_tokens_source"] == "usage" and doc["short_outputs"] == 0
    assert doc["total_output_tokens"] == requests * output_len
    assert doc["total_input_tokens"] >= requests * 8
    duration = doc["duration_s"]
    assert 0 < duration < 60
    assert doc["request_throughput"] == pytest.approx(requests / duration)
    assert doc["output_token_throughput"] == pytest.approx(requests * output_len / duration)
    for name in LATENCIES:
        dist = doc[name]
        if name == "itl_ms" and gaps_may_merge and dist["mean"] is None:
            assert all(dist[k] is None for k in ("min", "p50", "p90", "p99", "max")), dist
            continue
        assert all(isinstance(dist[k], float) for k in ("mean", "p50", "p90", "p99")), name
        assert 0 <= dist["min"] <= dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    ttft, tpot, e2el = doc["ttft_ms"], doc["tpot_ms"], doc["e2el_ms"]
    for k in ("min", "p50", "p90", "p99", "max", "mean"):  # ttft <= e2el per request
        assert ttft[k] <= e2el[k]
    # e2el = ttft + (n - 1) * tpot per request, so the means add up too.
    assert e2el["mean"] == pytest.approx(ttft["mean"] + (output_len - 1) * tpot["mean"])
    assert doc["itl_ms"]["max"] is None or doc["itl_ms"]["max"] <= e2el["max"]  # (None: merged)


def test_bench_serve_against_a_disaggregated_cluster(cluster: Service, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    run = _bench(
        cluster,
        *("--num-requests", "12", "--max-concurrency", "4"),
        *("--input-len", "16", "--output-len", "6"),
        *("--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--slo-e2el-ms", "0.001"),
        *("--json", str(out), "--plot-dir", str(tmp_path)),
    )
    assert run.returncode == 0, run.stderr
    assert "Serving Benchmark Result" in run.stdout and "Mean TTFT (ms)" in run.stdout
    assert "12/12 done" in run.stderr  # the progress bar's last line
    doc = json.loads(out.read_text())
    _check_plausible(doc, requests=12, output_len=6)
    assert doc["max_concurrent"] <= 4
    assert doc["config"]["model"] == http_json(f"{cluster.url}/v1/models")["data"][0]["id"]
    assert doc["goodput"] == 0.0  # nothing finishes within the 1 us e2e SLO
    assert (tmp_path / "cdf-rateinf.png").stat().st_size > 0
    cluster.wait_baseline()


def test_bench_serve_chat_rate_sweep(
    cluster: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(  # in process this time: the CLI path is the test above
        [
            *("--base-url", cluster.url, "--endpoint", "chat"),
            *("--rate", "20", "40", "--arrival", "fixed", "--num-requests", "6"),
            *("--input-len", "8", "--output-len", "4", "--no-progress"),
            *("--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"),
            *("--json", str(tmp_path / "sweep.json"), "--plot-dir", str(tmp_path)),
        ]
    )
    assert status == 0
    assert "TTFT p99" in capsys.readouterr().out  # the sweep table
    for rate in (20, 40):
        doc = json.loads((tmp_path / f"sweep-rate{rate}.json").read_text())
        assert doc["config"]["rate"] == rate and doc["config"]["endpoint"] == "chat"
        _check_plausible(doc, requests=6, output_len=4)
        assert doc["goodput"] == pytest.approx(doc["request_throughput"])
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 0
    cluster.wait_baseline()


def test_bench_serve_conversations_reuse_the_cache(cluster: Service, tmp_path: Path) -> None:
    """Issue 14's workload: conversations whose turns carry the history; later turns find
    the system prompt and earlier turns cached (the hit rate comes from usage)."""
    out = tmp_path / "talk.json"
    status = main(
        [
            *("--base-url", cluster.url, "--endpoint", "chat", "--num-requests", "3"),
            *("--turns", "3", "--think-time-s", "0.05", "--prefix-len", "64"),
            *("--input-len", "8", "--output-len", "4", "--no-progress", "--json", str(out)),
        ]
    )
    assert status == 0
    doc = json.loads(out.read_text())
    assert doc["completed"] == 9 and doc["failed"] == 0  # 3 conversations of 3 turns
    assert doc["config"]["conversation"]["turns"] == 3
    assert doc["cache_hit_rate"] > 0.3 and doc["total_cached_tokens"] > 0
    cluster.wait_baseline()


def test_bench_serve_goodput_search(cluster: Service, tmp_path: Path) -> None:
    """Issue 15: a small bounded search for DistServe's goodput on the same requests each run.
    Objectives every run meets: it doubles up to the max rate, which is then the goodput;
    a TTFT objective no request meets: it halves down to the min rate and reports 0."""
    common = [
        *("--base-url", cluster.url, "--num-requests", "4", "--arrival", "fixed"),
        *("--input-len", "8", "--output-len", "4", "--no-progress", "--goodput-search"),
        *("--rate", "10", "--slo-tpot-ms", "60000"),
    ]
    out = tmp_path / "search.json"
    status = main(
        [
            *common,
            *("--slo-ttft-ms", "60000", "--search-max-rate", "40", "--max-search-runs", "4"),
            *("--json", str(out), "--plot-dir", str(tmp_path)),
        ]
    )
    assert status == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "pdserve.bench_serve.goodput_search.v1"
    assert doc["goodput_distserve_rps"] == 40 and doc["stop_reason"] == "max_rate"
    assert doc["slo"] == {"ttft_ms": 60000, "tpot_ms": 60000}
    assert doc["attainment_threshold"] == 0.9 and doc["search"]["runs_used"] == 3
    assert doc["config"]["model"] and "rate" not in doc["config"]
    assert [row["rate"] for row in doc["curve"]] == [10, 20, 40]
    for row in doc["curve"]:
        assert row["attainment"] == 1.0 and row["passed"] and row["sent"] == 4
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
    assert [run["config"]["rate"] for run in doc["runs"]] == [10, 20, 40]
    for run in doc["runs"]:
        _check_plausible(run, requests=4, output_len=4, gaps_may_merge=True)
        assert run["config"]["seed"] == 0 and run["slo_attainment"] == 1.0
    assert (tmp_path / "attainment_vs_rate.png").stat().st_size > 0

    low = tmp_path / "zero.json"
    status = main([*common, "--slo-ttft-ms", "0.001", "--search-min-rate", "5", "--json", str(low)])
    assert status == 0  # requests completed; none met the objective
    zero = json.loads(low.read_text())
    assert zero["goodput_distserve_rps"] == 0.0 and zero["stop_reason"] == "min_rate"
    assert [(row["rate"], row["attainment"]) for row in zero["curve"]] == [(5, 0.0), (10, 0.0)]
    assert "no rate passed" in zero["note"]
    cluster.wait_baseline()
