"""The helpers of scripts/compare_disagg.sh: the mixed workload it writes and the report it
builds from any number of bench-serve results (their JSON made by bench-serve's own
summarize); and scripts/bench_engine.py's rows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from common.text.tokenizer import Tokenizer
from proxy.bench.client import RequestResult
from proxy.bench.search import RateSearch, SearchConfig, document
from proxy.bench.stats import Slo, detailed, summarize

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


def _report(argv: list[str], out: Path) -> str:
    assert _script("compare_report").main([*argv, "--out", str(out)]) == 0
    return out.read_text()


def _rows(text: str, section: str) -> list[str]:
    """The table rows of one `## section` of a report."""
    body = text.split(f"## {section}\n")[1].split("\n## ")[0]
    return [line for line in body.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_report_has_a_row_per_deployment_a_verdict_and_the_plots(tmp_path: Path) -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    gaps = {"colo-1x2": 0.080, "colo-2x1": 0.060, "static": 0.030, "auto": 0.020}
    argv = []
    for name, gap in gaps.items():  # the colocated ones miss the TPOT SLO
        _run(tmp_path / name, gap, slo)
        argv += ["--run", f"{'colocated' if 'colo' in name else 'disagg'}:{name}={tmp_path / name}"]
    text = _report([*argv, "--context", "ctx"], tmp_path / "report.md")
    assert "- ctx" in text and "TTFT <= 1000 ms and TPOT <= 50 ms" in text
    rows = _rows(text, "Results")
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| colo-1x2", "colocated"], ["| colo-2x1", "colocated"],
        ["| static", "disagg"], ["| auto", "disagg"],
    ]  # fmt: skip
    assert "0.00 | 0%" in rows[1] and "1.00 | 100%" in rows[3]
    assert "decode ITL p99: **auto** (20.0 ms; next static 30.0 ms, 1.5x lower)" in text
    assert "TTFT p50: tie (colo-1x2 100, colo-2x1 100, static 100, auto 100 ms)" in text
    assert "SLO-met req/s: tie (static 1.00, auto 1.00 req/s)" in text
    assert "- model: `smollm2-135m`" in text and "Goodput (DistServe)" not in text
    assert all(f"]({name}/cdf-rate1.png)" in text for name in gaps)
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert "**Goal not judged**: it needs each deployment's goodput search" in text


def test_report_splits_the_itl_tail_into_first_gaps_and_decode_steps(tmp_path: Path) -> None:
    """With --save-detailed records the report says which gaps make the ITL tail: here the
    disaggregated run's slow hand-offs (first gaps of 150 ms against steps of 30 ms)."""
    compare_report = _script("compare_report")

    slo = Slo(ttft_ms=1000, tpot_ms=200)
    for name, first, step in (("colo", 0.06, 0.06), ("pd", 0.15, 0.03)):
        results = _results(step)
        for r in results:
            r.itl_s[0] = first
        doc = {"config": _config(1.0), **summarize(results, 10.0, slo)}
        doc["requests"] = detailed(results)
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps(doc))
    split = compare_report.itl_split(json.loads((tmp_path / "pd" / "bench.json").read_text()))
    assert split["first_p50"] == pytest.approx(150.0) and split["later_p99"] == pytest.approx(30.0)
    assert (split["tail_first"], split["gaps"]) == (split["tail"], 190)  # 10 x 19 gaps
    argv = ["--run", f"colocated:colo={tmp_path / 'colo'}", "--run", f"disagg:pd={tmp_path / 'pd'}"]
    text = _report(argv, tmp_path / "report.md")
    assert "| pd | 150.0 ms / 150.0 ms | 30.0 ms / 30.0 ms | 10 of 10 (of 190 gaps) |" in text
    assert compare_report.itl_split({"itl_ms": {"p99": 1.0}}) is None  # no records, no split


def test_report_verdict_names_the_winner_and_the_next_best() -> None:
    verdict = _script("compare_report").verdict
    values = [("a", 80.0), ("b", 20.0), ("c", None), ("d", 60.0)]
    assert verdict("ITL", "ms", values, False) == "ITL: **b** (20.0 ms; next d 60.0 ms, 3x lower)"
    assert (
        verdict("g", "req/s", values, True)
        == "g: **a** (80.0 req/s; next d 60.0 req/s, 1.3x higher)"
    )
    zero = verdict("g", "req/s", [("a", 8.0), ("b", 0.0)], True)
    assert zero == "g: **a** (8.00 req/s; next b 0.00 req/s)"  # goodput 0: no ratio
    assert verdict("g", "req/s", [("a", 8.0), ("b", None)], True) == "g: n/a"


def test_report_takes_the_colocated_and_disagg_shorthands(tmp_path: Path) -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    _run(tmp_path / "colocated", 0.080, slo)
    _run(tmp_path / "disagg", 0.020, slo)
    argv = ["--colocated", str(tmp_path / "colocated"), "--disagg", str(tmp_path / "disagg")]
    text = _report(argv, tmp_path / "report.md")
    rows = [row.split(" | ")[:2] for row in _rows(text, "Results")]
    assert rows == [["| colocated", "colocated"], ["| 1P1D", "disagg"]]
    assert "decode ITL p99: **1P1D** (20.0 ms; next colocated 80.0 ms, 4x lower)" in text


def test_report_refuses_bad_runs(tmp_path: Path) -> None:
    slo = Slo(ttft_ms=1000, tpot_ms=50)
    _run(tmp_path / "a", 0.080, slo)
    main = _script("compare_report").main
    out = ["--out", str(tmp_path / "report.md")]
    for bad in ("a", "colocated:a", "both:a=x", "colocated:=x", "colocated:a|b=x"):
        with pytest.raises(SystemExit) as exit_:
            main(["--run", bad, *out])
        assert exit_.value.code == 2
    same = f"colocated:a={tmp_path / 'a'}"
    assert main(["--run", same, "--run", same, *out]) == 2  # one label twice
    assert main(["--run", f"disagg:b={tmp_path / 'missing'}", *out]) == 2
    assert not (tmp_path / "report.md").exists()


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
    (run_dir / "goodput").mkdir(exist_ok=True)
    (run_dir / "goodput" / "search.json").write_text(json.dumps(doc))


def _deployments(root: Path, table: dict[str, tuple[str, float, float]]) -> list[str]:
    """One run dir per `label: (kind, ITL gap s, goodput knee req/s)`; their --run flags."""
    slo, argv = Slo(ttft_ms=1000, tpot_ms=50), []
    root.mkdir()
    for label, (kind, gap, knee) in table.items():
        _run(root / label, gap, slo)
        _search(root / label, knee, slo)
        argv += ["--run", f"{kind}:{label}={root / label}"]
    return argv


FOUR = {
    "colo-1x2": ("colocated", 0.080, 1.5),
    "colo-2x1": ("colocated", 0.060, 2.0),
    "static": ("disagg", 0.021, 5.0),
    "auto": ("disagg", 0.020, 5.0),
}


def test_report_states_goodput_distserve_per_deployment(tmp_path: Path) -> None:
    argv = _deployments(tmp_path / "four", FOUR)
    text = _report(argv, tmp_path / "report.md")
    assert "## Goodput (DistServe)" in text and "Model `smollm2-135m`" in text
    assert "TTFT <= 1000 ms and TPOT <= 50 ms, met by at least 90% of the requests" in text
    rows = _rows(text, "Goodput (DistServe)")
    labels = ["| colo-1x2", "| colo-2x1", "| static", "| auto"]
    assert [row.split(" | ")[0] for row in rows] == [*labels, "| deployment", *labels]
    load, rows = rows[5:], rows[:4]  # the second table: decode under load, by search rate
    assert "Decode under load, from the search runs: ITL p99 / TPOT p99" in text
    assert all(row.count(": ") == 5 for row in load[:1]), load
    assert "| colocated | 1.5 | 1.5 / 1.625 | 5 |" in rows[0]
    assert "1: 100%, 1.5: 100%, 1.625: 0%, 1.75: 0%, 2: 0%" in rows[0]
    assert "| colocated | 2 | 2 / 2.25 | 6 |" in rows[1]
    assert "| disagg | 5 | 5 / 6 | 6 |" in rows[2] and "| disagg | 5 | 5 / 6 | 6 |" in rows[3]
    assert "goodput (DistServe): tie (static 5.00, auto 5.00 req/s)" in text
    assert "![SLO attainment against the offered rate](goodput.png)" in text
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert "goodput/" not in text.split("## Plots")[1]  # the search's own plots stay out

    (tmp_path / "four" / "auto" / "goodput" / "search.json").unlink()  # some only: refused
    assert _script("compare_report").main([*argv, "--out", str(tmp_path / "r2.md")]) == 2


def _goal(text: str) -> list[str]:
    return [line for line in text.split("## Goal\n")[1].split("\n## ")[0].splitlines() if line]


def test_report_goal_met_best_disagg_against_better_colocated(tmp_path: Path) -> None:
    text = _report(_deployments(tmp_path / "four", FOUR), tmp_path / "report.md")
    assert _goal(text)[1:] == [  # auto: of the two at 5 req/s, the lower ITL p99
        "- goodput: auto 5 req/s / colo-2x1 2 req/s = 2.50x (>= 1.5x: met)",
        "- decode ITL p99: auto 20.0 ms / colo-2x1 60.0 ms = 0.33x (<= 0.5x: met)",
        # the search runs' ITL depends only on the rate here: at 2 req/s both ran 20 ms
        "- not judged, under load: decode ITL p99 at colo-2x1's goodput rate (2 req/s): "
        "auto 20.0 ms (at 2 req/s) / colo-2x1 20.0 ms = 1.00x",
        "**Goal met** (auto against colo-2x1).",
    ]


def _probe(run_dir: Path, decode: float, prefill: float | None) -> None:
    """A speed probe as `bench_engine.py --json` writes it (prefill None: no such row)."""
    rows = [{"what": "decode", "size": 8, "pdserve_tok_s": decode, "transformers_tok_s": None}]
    if prefill is not None:
        rows.append({"what": "prefill", "size": 800, "pdserve_tok_s": prefill})
    doc = {"model": "smollm2-135m", "dtype": "float32", "threads": 1, "rows": rows}
    (run_dir / "speed-probe.json").write_text(json.dumps(doc))


def test_report_states_the_machine_speed_before_each_deployment(tmp_path: Path) -> None:
    argv = _deployments(tmp_path / "four", FOUR)
    assert "Machine speed" not in _report(argv, tmp_path / "none.md")  # no probes, no section
    speeds = {"colo-1x2": (100.0, 400.0), "colo-2x1": (90.0, 440.0), "static": (80.0, None)}
    for name, (decode, prefill) in speeds.items():
        _probe(tmp_path / "four" / name, decode, prefill)
    text = _report(argv, tmp_path / "report.md")
    assert _rows(text, "Machine speed") == [
        "| colo-1x2 | 100.0 (decode 8) | 400.0 (prefill 800) |",
        "| colo-2x1 | 90.0 (decode 8) | 440.0 (prefill 800) |",
        "| static | 80.0 (decode 8) | - |",
    ]
    assert "float32, 1 thread(s) pinned to the first core" in text
    body = text.split("## Machine speed\n")[1].split("\n## ")[0]
    assert "slowest probe below the fastest: decode 20%, prefill 9%. Not probed: auto." in body
    assert (
        "- not judged, the machine's speed: the slowest speed probe below the fastest by "
        "decode 20%, prefill 9% (see Machine speed)"
    ) in _goal(text)


def test_report_goal_not_met_on_either_ratio(tmp_path: Path) -> None:
    close_itl = FOUR | {"colo-2x1": ("colocated", 0.030, 2.0)}  # 20 / 30 ms
    text = _report(_deployments(tmp_path / "itl", close_itl), tmp_path / "itl.md")
    assert "- goodput: auto 5 req/s / colo-2x1 2 req/s = 2.50x (>= 1.5x: met)" in text
    assert "- decode ITL p99: auto 20.0 ms / colo-2x1 30.0 ms = 0.67x (<= 0.5x: not met)" in text
    assert "**Goal not met** (auto against colo-2x1)." in text

    low_goodput = FOUR | {"static": ("disagg", 0.021, 2.5), "auto": ("disagg", 0.020, 2.5)}
    argv = _deployments(tmp_path / "goodput", low_goodput)
    text = _report([*argv, "--goal-goodput-ratio", "1.2"], tmp_path / "goodput.md")
    assert "- goodput: auto 2.5 req/s / colo-2x1 2 req/s = 1.25x (>= 1.2x: met)" in text
    text = _report(argv, tmp_path / "goodput.md")
    assert "- goodput: auto 2.5 req/s / colo-2x1 2 req/s = 1.25x (>= 1.5x: not met)" in text
    assert "**Goal not met** (auto against colo-2x1)." in text


def test_report_goal_ratio_on_the_bound_is_met() -> None:
    """2.4 / 1.6 is 1.4999999999999998 in floating point (session 32's G20 was judged "not
    met" by it); a ratio on the bound is on it, either way round."""
    check = _script("compare_report")._check
    assert check(2.4, 1.6, 1.5, True) == ("1.50x", "met")
    assert check(2.3, 1.6, 1.5, True) == ("1.44x", "not met")
    assert check(0.3, 0.6, 0.5, False) == ("0.50x", "met")
    assert check(0.31, 0.6, 0.5, False) == ("0.52x", "not met")
    assert check(1.0, 0.0, 1.5, True) == ("no finite ratio", "met")


def test_report_measures_every_goodput_against_the_machines_capacity(tmp_path: Path) -> None:
    argv = _deployments(tmp_path / "four", FOUR)
    assert "Machine capacity" not in _report(argv, tmp_path / "none.md")  # no file, no section
    doc = {"dtype": "float32", "threads": 1, "requests": 100, "prompt_tokens": 20000}
    doc |= {"output_tokens": 5000, "wall_s": 20.0, "requests_per_s": 5.0}
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps(doc))
    text = _report([*argv, "--capacity", str(capacity)], tmp_path / "report.md")
    body = text.split("## Machine capacity\n")[1].split("\n## ")[0]
    assert "served 100 of the workload's requests (20000 prompt and 5000 output tokens)" in body
    assert "in 20.0 s: **5.00 req/s per core**" in body
    assert "more than 2 x that, **10.00 req/s**" in body
    assert _rows(text, "Machine capacity") == [
        "| colo-1x2 | 1.5 | 15% |", "| colo-2x1 | 2 | 20% |", "| static | 5 | 50% |",
        "| auto | 5 | 50% |",
    ]  # fmt: skip
    assert (
        "- not judged, the machine's ceiling: 10.00 req/s (see Machine capacity) / colo-2x1 "
        "2 req/s = 5.00x, the most any deployment could reach over colo-2x1 on this machine; "
        "auto reached 50% of the ceiling, colo-2x1 20%"
    ) in _goal(text)
    assert "**Goal met** (auto against colo-2x1)." in text  # the ceiling judges nothing

    text = _report([*argv, "--capacity", str(capacity), "--capacity-cores", "1"], tmp_path / "1.md")
    assert "more than 1 x that, **5.00 req/s**" in text and "| auto | 5 | 100% |" in text
    capacity.write_text(json.dumps(doc | {"requests_per_s": 0}))
    report = _script("compare_report")
    assert report.main([*argv, "--capacity", str(capacity), "--out", str(tmp_path / "r.md")]) == 2


def test_workload_capacity_serves_every_request_of_the_dataset_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "mixed.jsonl"
    lines = [{"prompt": "the quick brown fox " * n, "max_tokens": m} for n, m in [(2, 5), (40, 3)]]
    lines += [{"prompt": "jumps over the lazy dog", "max_tokens": 7}] * 4
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "capacity.json"
    argv = ["--model", str(tiny_model_dir), "--data", str(data), "--requests", "5"]
    threads = torch.get_num_threads()
    try:
        assert _script("workload_capacity").main([*argv, "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the script sets the process's torch threads
    doc = json.loads(out.read_text())
    assert doc["requests"] == 5 and doc["output_tokens"] == 5 + 3 + 7 * 3  # the first 5 lines
    assert doc["threads"] == 1 and doc["dtype"] == "float32" and doc["prompt_tokens"] > 40
    assert doc["requests_per_s"] == pytest.approx(5 / doc["wall_s"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _script("workload_capacity").main([*argv[:2], "--data", str(empty)]) == 2


def test_report_goal_not_judged_without_both_kinds(tmp_path: Path) -> None:
    only = {k: v for k, v in FOUR.items() if k.startswith("colo")}
    text = _report(_deployments(tmp_path / "colo", only), tmp_path / "report.md")
    assert "**Goal not judged**: it needs a colocated and a disaggregated run." in text
    assert (
        "## Goodput (DistServe)" in text and len(_rows(text, "Goodput (DistServe)")) == 5
    )  # 2 + header + 2


def test_report_goal_judges_a_lower_bound_goodput_only_when_it_decides(tmp_path: Path) -> None:
    colo_bound = FOUR | {"colo-2x1": ("colocated", 0.060, 100.0)}  # passes up to max rate 16
    text = _report(_deployments(tmp_path / "colo", colo_bound), tmp_path / "colo.md")
    assert (
        "- goodput: auto 5 req/s / colo-2x1 16 req/s = 0.31x (>= 1.5x: not judged; colo-2x1: "
        "a lower bound only (no search run failed))" in text
    )
    assert "(<= 0.5x: met)" in text and "**Goal not judged** (auto against colo-2x1)." in text

    past = FOUR | {"auto": ("disagg", 0.020, 100.0)}  # >= 16 against 2: met all the same
    text = _report(_deployments(tmp_path / "past", past), tmp_path / "past.md")
    assert "- goodput: auto 16 req/s / colo-2x1 2 req/s = 8.00x (>= 1.5x: met)" in text
    assert "**Goal met** (auto against colo-2x1)." in text

    short = past | {"colo-2x1": ("colocated", 0.060, 12.0)}  # >= 16 against 12: undecided
    goal = _goal(_report(_deployments(tmp_path / "short", short), tmp_path / "short.md"))
    assert goal[1].endswith(
        "(>= 1.5x: not judged; auto: a lower bound only (no search run failed))"
    )
    assert goal[-1] == "**Goal not judged** (auto against colo-2x1)."


def _dry_run(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = str(SCRIPTS / "compare_disagg.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPARE_")} | env
    return subprocess.run(
        ["bash", script, "--dry-run", *argv], env=env, capture_output=True, text=True, timeout=30
    )


@pytest.mark.e2e
def test_compare_disagg_composes_each_deployments_flags() -> None:
    common = "--threads-per-node 1 --pin-cores"
    lines = _dry_run(COMPARE_UP_ARGS="--kv-backend zmq").stdout.splitlines()
    assert lines == [
        "colocated-1x2 (colocated): `pdserve up --colocated --threads-per-node 2 --pin-cores"
        " --kv-backend zmq`",
        f"colocated-2x1 (colocated): `pdserve up --colocated 2 {common} --kv-backend zmq`",
        f"1p1d-static (disagg): `pdserve up --prefill 1 --decode 1 {common} --disagg-mode always"
        " --kv-backend zmq`",
        f"1p1d-auto (disagg): `pdserve up --prefill 1 --decode 1 {common} --disagg-mode auto"
        " --kv-backend zmq`",
    ]
    env = {"COMPARE_DEPLOYMENTS": "colocated-1x2", "COMPARE_AUTO_ARGS": "--kv-streaming on"}
    picked = _dry_run("--deployments", "1p1d-auto,colocated-2x1", **env).stdout.splitlines()
    assert picked == [  # --deployments wins, in its order; the extra flags for auto only
        f"1p1d-auto (disagg): `pdserve up --prefill 1 --decode 1 {common} --disagg-mode auto"
        " --kv-streaming on`",
        f"colocated-2x1 (colocated): `pdserve up --colocated 2 {common}`",
    ]
    # a quoted value stays one flag (split as a shell would), and is shown quoted
    env = {"COMPARE_STATIC_ARGS": '--prefill-node-args="--dtype float32" --kv-backend zmq'}
    (static,) = _dry_run("--deployments", "1p1d-static", **env).stdout.splitlines()
    assert static.endswith("--disagg-mode always '--prefill-node-args=--dtype float32'"
                           " --kv-backend zmq`")  # fmt: skip
    for bad in ("1p1d", "1p1d-auto,1p1d-auto", ""):
        done = _dry_run("--deployments", bad)
        assert done.returncode == 2 and "compare_disagg:" in done.stderr and not done.stdout


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


def test_bench_engine_overhead_times_every_mode(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--model", str(tiny_model_dir), "--overhead", "1,2", "--prompt-len", "8"]
    argv += ["--output-len", "6", "--repeats", "1", "--threads", "1", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        _script("bench_engine").main(argv)
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["overhead"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r["tok_s"]) == {"plain", "logprobs", "structured"}
        assert all(v > 0 for v in r["tok_s"].values())


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


def test_report_counts_where_the_proxy_placed_each_prompt(tmp_path: Path) -> None:
    """From the proxy's own /metrics text scraped after the warm-up, the fixed-rate run and
    the search: only what each stage placed, by placement and reason."""
    from prometheus_client import CollectorRegistry, generate_latest

    from proxy.pool.placement import DisaggMode, PlacementMetrics

    registry = CollectorRegistry()
    counter = PlacementMetrics(registry, DisaggMode.AUTO).decisions
    slo = Slo(ttft_ms=1000, tpot_ms=200)
    for name in ("colo", "auto"):
        _run(tmp_path / name, 0.03, slo)
    stages = (  # (placement, reason, count) added in each stage
        [("remote", "mode", 2)],  # the warm-up
        [("local", "earlier", 5), ("remote", "stalls_decode", 4), ("local", "meets_ttft_slo", 1)],
        [("remote", "stalls_decode", 30), ("local", "earlier", 7)],
    )
    scrapes = ("metrics-warm", "metrics-bench", "metrics-search")
    for scrape, added in zip(scrapes, stages, strict=True):
        for where, reason, n in added:
            counter.labels("auto", where, reason).inc(n)
        (tmp_path / "auto" / f"{scrape}.txt").write_bytes(generate_latest(registry))
    argv = ["--run", f"colocated:colo={tmp_path / 'colo'}"]
    text = _report([*argv, "--run", f"disagg:auto={tmp_path / 'auto'}"], tmp_path / "report.md")
    fixed = "remote 4 (stalls_decode 4); local 6 (earlier 5, meets_ttft_slo 1)"
    assert f"| auto | {fixed} | remote 30 (stalls_decode 30); local 7 (earlier 7) |" in text
    assert "| colo |" not in text.split("prefilled each prompt")[1].split("\n## ")[0]
