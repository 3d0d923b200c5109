#!/usr/bin/env python3
"""Offered load at 1x, 2x and 4x the measured capacity (issue 18): does goodput hold?

    python scripts/overload.py [--model M] [--window-s 30] [--multipliers 1,2,4]
        [--edge-deadline-s 10] [--input-len 128] [--output-len 16] [--out DIR]

Starts one `pdserve up` (default 1P1D, `--edge-deadline-s` passed on), measures its capacity
C (completed requests per second of an all-at-once burst of --capacity-requests), then for
each multiplier m offers m*C requests per second for --window-s seconds, as a Poisson stream
and as one all-at-once burst of the same size. Per run it reports completed/s, rejected/s
(503 at the edge), requests failed in any other way, TTFT p50/p99 of the admitted requests
that completed, and how many prompts were prefilled (by the prefill nodes, or by a decode
node itself when the proxy placed one there: conditional disaggregation): with
admission at the edge that equals the completed count (no compute thrown away). Output:
DIR/report.md (the table), DIR/report.json, bench-serve's JSON per run, up.log and the
node logs. The service is stopped by pid when the script ends, on error too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # pdserve's packages; up_service

from up_service import UpService, sample_sum  # noqa: E402

from common.cli.models import model_dir  # noqa: E402
from proxy.bench.main import main as bench_serve  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/overload"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--capacity-requests", type=int, default=96, help="the measuring burst")
    p.add_argument("--window-s", type=float, default=30.0, help="each run offers this long")
    p.add_argument("--multipliers", default="1,2,4")
    p.add_argument("--edge-deadline-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--up-args", default="", help="more `pdserve up` flags")
    return p


def _prefilled(up: UpService) -> float:
    """Prompts computed: by the prefill nodes, and by decode nodes themselves (the proxy's
    local placements, conditional disaggregation)."""
    local = sample_sum(up.metrics(), "pdserve_proxy_placements_total", placement="local")
    return local + sum(
        sample_sum(up.metrics(url), "pdserve_node_requests_total", outcome="prefilled")
        for url in up.node_urls("prefill")
    )


def run(up: UpService, args: argparse.Namespace, name: str, n: int, rate: str) -> dict[str, Any]:
    """One bench-serve run of `n` requests at `rate`; its numbers and the nodes' counts."""
    out = args.out / f"{name.replace(' ', '-')}.json"
    argv = ["--base-url", up.url, "--endpoint", "completions", "--tokenizer", args.tokenizer,
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--num-requests", str(n), "--rate", rate, "--seed", str(args.seed),
            "--request-timeout-s", "600", "--no-progress", "--json", str(out)]  # fmt: skip
    before = _prefilled(up), sample_sum(up.metrics(), "pdserve_edge_rejections_total")
    bench_serve(argv)  # exit status 1 when nothing completed: the numbers still tell
    prefilled = _prefilled(up) - before[0]
    at_edge = sample_sum(up.metrics(), "pdserve_edge_rejections_total") - before[1]
    doc = json.loads(out.read_text())
    return {
        "run": name,
        "offered": n,
        "rate": rate,
        "duration_s": doc["duration_s"],
        "completed": doc["completed"],
        "rejected": doc["rejected"],
        "other_failures": doc["failed"] - doc["rejected"],
        "completed_per_s": doc["request_throughput"],
        "rejected_per_s": doc["rejected_throughput"],
        "ttft_p50_ms": doc["ttft_ms"]["p50"],
        "ttft_p99_ms": doc["ttft_ms"]["p99"],
        "prefilled": prefilled,
        "refused_at_edge": at_edge,
        "errors": doc["errors"]["by_kind"],
    }


def report(capacity: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    c = capacity["completed_per_s"]
    lines = [
        "# Overload: offered load against measured capacity",
        "",
        f"- {args.prefill}P{args.decode}D, model {args.model}; prompts of {args.input_len} "
        f"tokens, {args.output_len} output tokens; edge deadline {args.edge_deadline_s:g} s",
        f"- capacity C = {c:.2f} requests/s (a burst of {capacity['offered']} all at once: "
        f"{capacity['completed']} completed in {capacity['duration_s']:.1f} s)",
        f"- each run offers m*C requests/s for {args.window_s:g} s: Poisson arrivals, or all "
        "of them at once (burst)",
        "",
        "| run | offered | completed/s | rejected/s | other failures | TTFT p50 ms | "
        "TTFT p99 ms | prefilled / completed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in [capacity, *rows]:
        p50, p99 = r["ttft_p50_ms"], r["ttft_p99_ms"]
        lines.append(
            f"| {r['run']} | {r['offered']} | {r['completed_per_s']:.2f} | "
            f"{r['rejected_per_s']:.2f} | {r['other_failures']} | "
            f"{'-' if p50 is None else f'{p50:.0f}'} | {'-' if p99 is None else f'{p99:.0f}'} | "
            f"{r['prefilled']:.0f} / {r['completed']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.tokenizer = model_dir(args.model)
    up_args = ["--model", args.model, "--prefill", str(args.prefill), "--decode",
               str(args.decode), "--edge-deadline-s", str(args.edge_deadline_s),
               *args.up_args.split()]  # fmt: skip
    with UpService(up_args, args.out / "service", args.startup_timeout_s) as up:
        run(up, args, "warmup", min(32, args.capacity_requests), "inf")  # kernels, caches
        capacity = run(up, args, "capacity", args.capacity_requests, "inf")
        c = capacity["completed_per_s"]
        rows = []
        for m in (float(x) for x in args.multipliers.split(",")):
            n = max(1, round(m * c * args.window_s))
            print(f"[overload] {m:g}x: {n} requests", file=sys.stderr)
            rows.append(run(up, args, f"{m:g}x poisson", n, f"{m * c:.3f}"))
            rows.append(run(up, args, f"{m:g}x burst", n, "inf"))
    text = report(capacity, rows, args)
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps([capacity, *rows], indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
