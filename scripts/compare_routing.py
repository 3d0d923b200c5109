#!/usr/bin/env python3
"""Routing policies and prefix caching compared on one seeded workload (issue 14).

    python scripts/compare_routing.py [--quick] [--out DIR] [--model M]
        [--deployments cost,cache-affinity,least-load,round-robin,no-cache]
        [--turns T --think-time-s S]     # multi-turn chats instead of one shared prefix

Each deployment is `pdserve up --prefill P --decode D` (default 2P2D) with `--routing X`
(`no-cache`: `--routing cost --no-prefix-caching`), started on loopback port 0, warmed
up, given the same bench-serve run (random prompts after a shared prefix of --prefix-len
tokens, as a system prompt; or, with --turns, conversations whose turns resend the history;
the seed fixes prompts and arrivals), then stopped by pid (`up_service.UpService`), also
when the run fails. The report (DIR/report.md, DIR/report.json)
has, per deployment: TTFT p50/p99, TPOT p50, the prefix cache hit rate (usage.cached_tokens
over prompt tokens), KV bytes moved per request (the prefill nodes' transfer-bytes
histograms, from /metrics), and the routing decisions where cache and queue disagreed; and a
bar chart of TTFT p50/p99 (DIR/ttft.png). Per deployment DIR/NAME/ holds bench.json, up.log
and the node logs.

Defaults are sized for SmolLM2-135M on a 2-core machine (a few minutes per deployment);
--quick is a smoke run whose numbers mean little.
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

from up_service import UpService, sample_sum  # noqa: E402

from common.cli.models import model_dir  # noqa: E402
from proxy.bench.main import main as bench_serve  # noqa: E402

DEPLOYMENTS = {
    "cost": ["--routing", "cost"],
    "cache-affinity": ["--routing", "cache-affinity"],
    "least-load": ["--routing", "least-load"],
    "round-robin": ["--routing", "round-robin"],
    "no-cache": ["--routing", "cost", "--no-prefix-caching"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/compare-routing"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=768, help="shared prompt tokens")
    p.add_argument("--input-len", type=int, default=96, help="each prompt's own tokens")
    p.add_argument(
        "--num-prefixes", type=int, default=1,
        help="distinct shared prefixes (tenants), picked with Zipf weights 1/k**--prefix-zipf",
    )  # fmt: skip
    p.add_argument("--prefix-zipf", type=float, default=0.0)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=40, help="with --turns: conversations")
    p.add_argument(
        "--turns", type=int, default=1,
        help="> 1: multi-turn chats (bench-serve's conversation mode: --prefix-len is the "
        "system prompt, --input-len each user message; every turn resends the history)",
    )  # fmt: skip
    p.add_argument("--think-time-s", type=float, default=0.0, help="between a chat's turns")
    p.add_argument("--rate", default="0.5", help="requests per second (bench-serve --rate)")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup-requests", type=int, default=2,
        help="unmeasured requests first (another seed); above 2, with the measured run's "
        "prefixes, at --rate: the measured run then starts from warm caches",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="8 requests: a smoke run")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--prefill-cache-blocks", type=int, default=0,
        help="> 0: each prefill node's KV blocks (--num-blocks); a cache smaller than the "
        "tenants' prefixes together makes where each tenant is routed matter",
    )  # fmt: skip
    p.add_argument(
        "--up-args", default="", help="more `pdserve up` flags for every deployment (shell-quoted)"
    )
    return p


def deploy(name: str, args: argparse.Namespace) -> UpService:
    """One `pdserve up` for deployment `name`, in DIR/NAME/."""
    up_args = ["--model", args.model, "--prefill", str(args.prefill), "--decode",
               str(args.decode), *DEPLOYMENTS[name], *shlex.split(args.up_args)]  # fmt: skip
    if args.prefill_cache_blocks > 0:
        up_args += ["--prefill-node-args", f"--num-blocks {args.prefill_cache_blocks}"]
    return UpService(up_args, args.out / name, args.startup_timeout_s)


def _bench(
    dep: UpService, args: argparse.Namespace, n: int, seed: int, out: Path | None, warm: bool
) -> None:
    endpoint = "chat" if args.turns > 1 else "completions"
    argv = ["--base-url", dep.url, "--endpoint", endpoint, "--tokenizer", args.tokenizer,
            "--prefix-len", str(args.prefix_len), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--num-requests", str(n), "--rate", args.rate,
            "--max-concurrency", str(args.max_concurrency), "--seed", str(seed),
            "--no-progress", "--request-timeout-s", "300", "--drain-timeout-s", "300"]  # fmt: skip
    if args.turns > 1:
        argv += ["--turns", str(args.turns), "--think-time-s", str(args.think_time_s)]
    else:
        argv += ["--num-prefixes", str(args.num_prefixes), "--prefix-zipf", str(args.prefix_zipf)]
        if warm:  # the measured run's tenants (prefixes), other prompts
            argv += ["--prefix-seed", str(args.seed)]
    if out is not None:
        argv += ["--json", str(out)]
    if bench_serve(argv) != 0:
        raise RuntimeError(f"{dep.dir.name}: bench-serve failed")


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    dep = deploy(name, args)
    try:
        # Warm-up: another seed, so its prompts are not the measured ones; with
        # --warmup-requests > 2 (random prompts) the measured run's prefixes, routed by the
        # policy under test, so the run starts with the caches that policy fills.
        warm = args.warmup_requests > 2 and args.turns == 1
        _bench(dep, args, args.warmup_requests, args.seed + 1000, None, warm)
        before = _kv_bytes(dep)
        _bench(dep, args, args.num_requests, args.seed, dep.dir / "bench.json", False)
        moved = _kv_bytes(dep) - before
        decisions = sample_sum(
            dep.metrics(), "pdserve_proxy_routing_decisions_total",
            cache_vs_queue="disagree",
        )  # fmt: skip
    finally:
        dep.stop()
    doc = json.loads((dep.dir / "bench.json").read_text())
    completed = doc["completed"] or 1
    return {
        "deployment": name,
        "ttft_p50_ms": doc["ttft_ms"]["p50"],
        "ttft_p99_ms": doc["ttft_ms"]["p99"],
        "tpot_p50_ms": (doc.get("tpot_ms") or {}).get("p50"),
        "cache_hit_rate": doc["cache_hit_rate"],
        "kv_bytes_per_request": moved / completed,
        "disagreeing_decisions": decisions,
        "completed": doc["completed"],
        "failed": doc["failed"],
    }


def _kv_bytes(dep: UpService) -> float:
    return sum(
        sample_sum(dep.metrics(url), "pdserve_transfer_bytes_sum")
        for url in dep.node_urls("prefill")
    )


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    shared = f"{args.prefix_len} shared tokens"
    if args.num_prefixes > 1:
        shared = (
            f"one of {args.num_prefixes} shared prefixes of {args.prefix_len} tokens (the k-th "
            f"picked with weight 1/k^{args.prefix_zipf:g})"
        )
    what, prompts = (
        "requests",
        f"- prompts: {shared} + {args.input_len} of their own; {args.output_len} output tokens",
    )
    if args.turns > 1:
        what, prompts = (
            "conversations",
            (
                f"- conversations of {args.turns} turns ({args.think_time_s:g} s think time): a "
                f"system prompt of {args.prefix_len} tokens shared by all, user messages of "
                f"{args.input_len} tokens, answers of {args.output_len}; each turn resends the "
                "history with the previous answers"
            ),
        )
    lines = [
        "# Routing and prefix caching compared",
        "",
        f"- {args.prefill}P{args.decode}D, model {args.model}; {args.num_requests} {what} at "
        f"{args.rate} per s (at most {args.max_concurrency} requests in flight), seed {args.seed}",
        prompts,
        "",
        "| deployment | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | cache hit rate | "
        "KV bytes / request | cache-vs-queue disagreements | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        hit = r["cache_hit_rate"]
        lines.append(
            f"| {r['deployment']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p50_ms'] or 0:.0f} | {'-' if hit is None else f'{hit:.0%}'} | "
            f"{r['kv_bytes_per_request'] / 2**20:.2f} MiB | {r['disagreeing_decisions']:.0f} | "
            f"{r['failed']} |"
        )
    by_name = {r["deployment"]: r for r in rows}
    if "cost" in by_name and "no-cache" in by_name:
        ratio = by_name["no-cache"]["ttft_p50_ms"] / max(by_name["cost"]["ttft_p50_ms"], 1e-9)
        lines += ["", f"TTFT p50 without the prefix cache / with it: {ratio:.2f}x"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [r["deployment"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] for r in rows], 0.4, label="TTFT p50")
    ax.bar([x + 0.2 for x in xs], [r["ttft_p99_ms"] for r in rows], 0.4, label="TTFT p99")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.num_requests = 8
    args.tokenizer = model_dir(args.model)  # exact prompt lengths in the model's tokens
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.deployments.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEPLOYMENTS]
    if unknown:
        print(f"compare_routing: unknown deployments {unknown}", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        print(f"[compare_routing] {name}", file=sys.stderr)
        rows.append(measure(name, args))
    text = report(rows, args)
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps(rows, indent=2))
    plot(rows, args.out / "ttft.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
