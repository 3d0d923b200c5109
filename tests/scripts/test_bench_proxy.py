"""scripts/bench_proxy.py end to end, briefly: the real proxy process in front of the
stand-in nodes (two proxies in front of the same nodes, as several proxies must work), every
phase, the JSON the issue asks for. Counts only (no speeds)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.scripts.test_compare_scripts import _script


@pytest.mark.e2e
def test_bench_proxy_relays_every_token_and_writes_its_json(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    out = tmp_path / "proxy.json"
    affinity = os.sched_getaffinity(0)
    argv = ["--model", str(tiny_model_dir), "--duration-s", "1", "--json", str(out)]
    argv += ["--streams", "4", "--output-tokens", "24", "--rate", "20"]
    argv += ["--proxies", "2"]  # two proxies in front of the same nodes, clients spread
    assert _script("bench_proxy").main(argv) == 0
    assert os.sched_getaffinity(0) == affinity  # the test process is not left pinned
    report = json.loads(out.read_text())
    assert report["proxies"] == 2
    assert report["kv_streaming"] == "on"  # the proxy's default: the streamed prefill call
    assert report["disagg_mode"] == "always"  # the bench's default: every prompt disaggregated
    for key in ("requests_per_s", "tokens_per_s", "added_ttft_ms_p99"):
        assert report[key] > 0
    phases = report["phases"]
    for phase in phases.values():
        assert phase["failed"] == 0 and phase["completed"] > 0
    throughput = phases["throughput"]
    # every request's tokens came through, as the usage chunk counts them
    assert throughput["tokens"] == throughput["completed"] * 24
    # every attempt of each proxy phase went to the prefill pool, counted by both proxies
    for name in ("throughput", "requests", "latency"):
        assert phases[name]["placements"] == {"remote/mode": phases[name]["completed"]}
    latency = phases["latency"]
    assert latency["completed"] == 20  # the open loop's bounded count: rate x duration
    # each event with decode tokens timed, write to read (lines that waited for the proxy
    # come merged, so there may be fewer events than tokens)
    assert 0 < latency["events_timed"] <= 20 * 15
    assert latency["token_relay_ms_p50"] >= 0
    # the proxy's own histograms saw the phase's requests and tokens
    assert latency["proxy_ttft_ms_p99"] is not None and latency["proxy_relay_ms_p99"] is not None
    # the floor: the same open loop through a proxy that only forwards, every token relayed
    floor = phases["floor"]
    assert floor["completed"] == 20 and floor["tokens"] == 20 * 16
    assert report["floor_ttft_ms_p99"] > 0
    over = latency["ttft_ms_p99"] - floor["ttft_ms_p99"]
    assert report["ttft_over_floor_ms_p99"] == pytest.approx(over, abs=1e-3)
    # no proxy: the client calls the stand-ins itself, every token read
    direct = phases["direct"]
    assert direct["completed"] == 20 and direct["tokens"] == 20 * 16
    assert direct["requests_per_s_per_proxy_core"] is None  # no proxy: no per-core rate
    assert report["direct_ttft_ms_p99"] > 0
    over = latency["ttft_ms_p99"] - direct["ttft_ms_p99"]
    assert report["ttft_over_direct_ms_p99"] == pytest.approx(over, abs=1e-3)


def test_a_phase_without_a_first_token_is_reported_not_a_crash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every latency-phase request failed (a broken proxy): the report says n/a where a
    difference needs first tokens, and prints; per-core rates only where a proxy ran."""
    bench = _script("bench_proxy")
    failed = bench.PhaseResult("latency", 1.0, 0.2, [bench.Outcome(False, error="HTTP 500")])
    direct = bench.PhaseResult("direct", 1.0, 0.0, [bench.Outcome(True, 16, 0.0002)])
    lat, base = failed.summary(), direct.summary()
    assert lat["errors"] == {"HTTP 500": 1} and lat["requests_per_s_per_proxy_core"] == 0.0
    assert base["requests_per_s_per_proxy_core"] is None
    assert base["tokens_per_s_per_proxy_core"] is None
    report = {
        "what": "test", "proxies": 1, "proxy_cores": [0],
        "phases": {
            "latency": {**lat, **bench._ttft_ms(failed), "token_relay_ms_p50": None,
                        "token_relay_ms_p99": None, "events_timed": 0,
                        "proxy_ttft_ms_p50": None, "proxy_ttft_ms_p99": None,
                        "proxy_relay_ms_p50": None, "proxy_relay_ms_p99": None},
            "direct": {**base, **bench._ttft_ms(direct)},
        },
        "ttft_over_direct_ms_p50": None, "ttft_over_direct_ms_p99": None,
    }  # fmt: skip
    bench.print_report(report)
    out = capsys.readouterr().out
    assert "over no proxy: p50 n/a ms, p99 n/a ms" in out
    assert "1 failed" in out
