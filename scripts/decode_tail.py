#!/usr/bin/env python3
"""Where a decode stream's time goes (issue 15): client, proxy, decode node and engine step,
measured in one run.

    python scripts/decode_tail.py [--model M] [--rate R] [--num-requests N]
        [--input-len I] [--output-len O] [--dataset JSONL] [--colocated] [--up-args "..."]
        [--out DIR]

Starts `pdserve up` (default 1P1D, one thread a node), warms it up, then runs one seeded
bench-serve load and scrapes every process's /metrics before and after it. The report
(DIR/report.md, DIR/report.json) puts side by side, as p50 / p99 over that run:

- the client's inter-token latency (bench-serve, what a user sees),
- the proxy's: ITL as chunks arrive from the node, and the relay time from a chunk's arrival
  to its event written to the client,
- the decode node's: the gap between consecutive token lines it writes, and its engine step
  time (decode-only steps, and all steps), split into admit / schedule / forward / sample /
  output; then its steps by batch kind (decode-only, mixed: decode with a prompt chunk,
  prefill-only), each kind's share of the run's wall time and of the node's step time, and
  the decode tokens per decode-only step (the batch it decoded).

`--dataset` sends a JSONL workload (bench-serve's `--dataset`: one prompt and max_tokens a
line, such as compare_disagg.sh's mixed.jsonl) instead of fixed-length random prompts, so
that the node's steps show what a mixed workload's local prefills and landed KV cost it.

A stall shows up first in the layer that owns it: if the node's gaps match its steps but
the client's do not, the time is lost between the node and the client; if the node's gaps
exceed its steps, on the node outside the engine step (its event loop, the hand-over).
The issue's target: a decode-only node's ITL p99 within 1.3x its step time p99.
Percentiles of the server-side histograms are interpolated within buckets 1.25x apart.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # pdserve's packages; up_service

from up_service import UpService, get, histogram_quantile, sample_sum  # noqa: E402

from common.cli.models import model_dir  # noqa: E402
from proxy.bench.main import main as bench_serve  # noqa: E402
from proxy.pool.placement import REASONS  # noqa: E402

PHASES = ("admit", "schedule", "forward", "sample", "output")
KINDS = ("decode", "mixed", "prefill")  # the step histogram's batch label


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/decode-tail"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--colocated", action="store_true", help="one colocated node instead")
    p.add_argument("--rate", default="1", help="requests per second (bench-serve --rate)")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dataset", type=Path, default=None, help="JSONL prompts instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--up-args", default="", help="more `pdserve up` flags")
    return p


def _bench(up: UpService, args: argparse.Namespace, n: int, seed: int, out: Path | None) -> None:
    argv = ["--base-url", up.url, "--tokenizer", args.tokenizer, "--num-requests", str(n),
            "--rate", args.rate, "--max-concurrency", str(args.max_concurrency), "--seed",
            str(seed), "--no-progress"]  # fmt: skip
    if args.dataset is None:
        argv += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    else:
        argv += ["--endpoint", "completions", "--dataset", str(args.dataset)]
    if out is not None:
        argv += ["--json", str(out)]
    if bench_serve(argv) != 0:
        raise RuntimeError("bench-serve completed no request")


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def measure(args: argparse.Namespace) -> dict[str, Any]:
    roles = ["--colocated"] if args.colocated else ["--prefill", "1", "--decode", "1"]
    up_args = ["--model", args.model, *roles, *shlex.split(args.up_args)]
    with UpService(up_args, args.out, args.startup_timeout_s) as up:
        _bench(up, args, 4, args.seed + 1000, None)  # warm-up
        decode_role = "both" if args.colocated else "decode"
        nodes = up.node_urls(decode_role)
        prefills = [] if args.colocated else up.node_urls("prefill")
        urls = [up.url, *nodes, *prefills]
        before = {u: get(u + "/metrics") for u in urls}
        _bench(up, args, args.num_requests, args.seed, args.out / "bench.json")
        after = {u: get(u + "/metrics") for u in urls}
    bench = json.loads((args.out / "bench.json").read_text())

    def q(url: str, name: str, quantile: float, **labels: str) -> float | None:
        return _ms(histogram_quantile(before[url], after[url], name, quantile, **labels)[0])

    def row(what: str, url: str, name: str, **labels: str) -> dict[str, Any]:
        count = histogram_quantile(before[url], after[url], name, 0.5, **labels)[1]
        return {"what": what, "p50_ms": q(url, name, 0.5, **labels),
                "p99_ms": q(url, name, 0.99, **labels), "count": count}  # fmt: skip

    itl = bench["itl_ms"] or {}
    rows: list[dict[str, Any]] = [{"what": "client ITL (bench-serve)", "p50_ms": itl.get("p50"),
             "p99_ms": itl.get("p99"), "count": None}]  # fmt: skip
    rows += [
        row("proxy ITL (chunk arrivals)", up.url, "pdserve_proxy_itl_seconds"),
        row("proxy relay (arrival to client write)", up.url, "pdserve_proxy_relay_seconds"),
    ]
    node = nodes[0]  # one decode node (or colocated node)
    step = "pdserve_engine_step_seconds"
    rows += [
        row("node ITL (token lines written)", node, "pdserve_node_itl_seconds"),
        row("step, decode-only batches", node, step, phase="total", batch="decode"),
        row("step, all batches", node, step, phase="total"),
    ]
    rows += [
        row(f"  {phase}, decode-only batches", node, step, phase=phase, batch="decode")
        for phase in PHASES
    ]

    def grew(url: str, name: str, **labels: str) -> float:  # a sample's growth in the run
        return sample_sum(after[url], name, **labels) - sample_sum(before[url], name, **labels)

    def by_kind(url: str) -> list[dict[str, Any]]:  # the node's steps by batch kind
        busy = grew(url, step + "_sum", phase="total")
        out = []
        for kind in KINDS:
            spent = grew(url, step + "_sum", phase="total", batch=kind)
            out.append({**row(kind, url, step, phase="total", batch=kind), "seconds": spent,
                        "share_of_wall": spent / bench["duration_s"],
                        "share_of_steps": spent / busy if busy else None})  # fmt: skip
        return out

    kinds = by_kind(node)
    placed = "pdserve_proxy_placements_total"
    placements = {f"{placement}/{reason}": n for placement in ("local", "remote")
                  for reason in REASONS
                  if (n := grew(up.url, placed, placement=placement, reason=reason))}  # fmt: skip
    decode_steps = kinds[0]["count"]
    tokens = grew(node, "pdserve_node_itl_seconds_count")
    prefill: dict[str, Any] | None = None
    if prefills:  # the one prefill node: how busy, and how long prompts waited in its queue
        url = prefills[0]
        prefill = {"kinds": by_kind(url),
                   "queue_wait": row("queue wait", url, "pdserve_queue_wait_seconds"),
                   "kv_exposed": row("KV exposed", node, "pdserve_kv_exposed_seconds")}  # fmt: skip
    by = {r["what"]: r for r in rows}
    step_p99 = by["step, decode-only batches"]["p99_ms"]
    ratios = {
        "node ITL p99 / decode step p99": _ratio(by["node ITL (token lines written)"], step_p99),
        "client ITL p99 / decode step p99": _ratio(by["client ITL (bench-serve)"], step_p99),
    }
    return {"rows": rows, "ratios": ratios, "kinds": kinds, "prefill": prefill,
            "placements": placements,
            "ttft_ms": bench["ttft_ms"],
            "tpot_ms": bench["tpot_ms"], "duration_s": bench["duration_s"],
            "gaps_per_decode_step": tokens / decode_steps if decode_steps else None,
            "completed": bench["completed"], "failed": bench["failed"]}  # fmt: skip


def _ratio(r: dict[str, Any], base: float | None) -> float | None:
    return r["p99_ms"] / base if r["p99_ms"] is not None and base else None


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    deployment = "colocated (1 node)" if args.colocated else "1P1D"
    shape = (
        f"{args.input_len} prompt tokens, {args.output_len} output tokens (ignore_eos)"
        if args.dataset is None
        else f"prompts from {args.dataset}"
    )
    lines = [
        "# Where decode time goes",
        "",
        f"- {deployment}, model {args.model}, `pdserve up {args.up_args}`; {args.num_requests} "
        f"requests at {args.rate} per s, {shape}, seed {args.seed}; {result['completed']} "
        f"completed, {result['failed']} failed in {result['duration_s']:.1f} s",
        "",
        "| where | p50 ms | p99 ms | samples |",
        "|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        count = "" if r["count"] is None else f"{r['count']:.0f}"
        lines.append(f"| {r['what']} | {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} | {count} |")
    lines.append("")
    for name, value in result["ratios"].items():
        lines.append(f"- {name}: {'-' if value is None else f'{value:.2f}x'}")
    lines += [
        "",
        "The decode node's steps by batch kind (decode-only; mixed: decode tokens with a prompt "
        "chunk; prefill-only), each kind's time as a share of the run and of all its steps:",
        "",
        *_kind_table(result["kinds"]),
    ]
    per_step = result["gaps_per_decode_step"]
    tpot = result["tpot_ms"] or {}
    lines += [
        "",
        f"- token gaps written per decode-only step (about the decode batch): "
        f"{'-' if per_step is None else f'{per_step:.1f}'}",
        f"- client TPOT p50 / p99: {_fmt(tpot.get('p50'))} / {_fmt(tpot.get('p99'))} ms",
    ]
    ttft = result["ttft_ms"] or {}
    lines.append(f"- client TTFT p50 / p99: {_fmt(ttft.get('p50'))} / {_fmt(ttft.get('p99'))} ms")
    placed = ", ".join(f"{k} {n:.0f}" for k, n in result["placements"].items())
    lines.append(f"- where the proxy placed the prompts (placement/reason): {placed or '-'}")
    prefill = result["prefill"]
    if prefill is not None:
        wait, exposed = prefill["queue_wait"], prefill["kv_exposed"]
        lines += [
            "",
            "The prefill node's steps, the same way (its queue wait: arrival in its engine "
            "queue to first scheduled):",
            "",
            *_kind_table(prefill["kinds"]),
            "",
            f"- prefill node queue wait p50 / p99: {_fmt(wait['p50_ms'])} / "
            f"{_fmt(wait['p99_ms'])} ms ({wait['count']:.0f} prompts)",
            f"- decode node KV exposed (first token sampled to KV landed) p50 / p99: "
            f"{_fmt(exposed['p50_ms'])} / {_fmt(exposed['p99_ms'])} ms",
        ]
    return "\n".join(lines) + "\n"


def _kind_table(kinds: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| batch | steps | p50 ms | p99 ms | seconds | of the run | of the steps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k in kinds:
        of_steps = "-" if k["share_of_steps"] is None else f"{k['share_of_steps']:.0%}"
        lines.append(
            f"| {k['what']} | {k['count']:.0f} | {_fmt(k['p50_ms'])} | {_fmt(k['p99_ms'])} | "
            f"{k['seconds']:.2f} | {k['share_of_wall']:.0%} | {of_steps} |"
        )
    return lines


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.tokenizer = model_dir(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    text = report(result, args)
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps(result, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
