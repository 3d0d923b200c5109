"""Markdown report of a colocated vs disaggregated comparison (`scripts/compare_disagg.sh`).

Each run directory holds one `pdserve bench-serve` result (`bench.json`) and its plots
(`*.png` from `--plot-dir`). The report: the setup, one table row per deployment (TTFT,
TPOT and ITL p50/p99, throughput, goodput at the runs' SLO), one line on who wins each
headline number, a bar chart of the p50/p99s side by side (`compare.png` beside the report)
and each run's plots, linked relative to the report.

    python scripts/compare_report.py --colocated out/compare/colocated \\
        --disagg out/compare/disagg --out out/compare/report.md --context "rate 1 req/s"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

TIE = 0.05  # relative difference under which neither side wins
COLUMNS = (
    ("done/sent", lambda r: f"{r['completed']}/{r['sent']}"),
    ("req/s", lambda r: _num(r["request_throughput"])),
    ("out tok/s", lambda r: _num(r["output_token_throughput"], ".1f")),
    ("TTFT p50", lambda r: _ms(r["ttft_ms"]["p50"])),
    ("TTFT p99", lambda r: _ms(r["ttft_ms"]["p99"])),
    ("TPOT p50", lambda r: _ms(r["tpot_ms"]["p50"])),
    ("TPOT p99", lambda r: _ms(r["tpot_ms"]["p99"])),
    ("ITL p50", lambda r: _ms(r["itl_ms"]["p50"])),
    ("ITL p99", lambda r: _ms(r["itl_ms"]["p99"])),
    ("goodput req/s", lambda r: _num(r["goodput"])),
    ("met SLO", lambda r: _pct(r["slo_attainment"])),
)
# (label, unit, how to read it from a run, higher is better)
HEADLINES = (
    ("decode ITL p99", "ms", lambda r: r["itl_ms"]["p99"], False),
    ("TTFT p50", "ms", lambda r: r["ttft_ms"]["p50"], False),
    ("TTFT p99", "ms", lambda r: r["ttft_ms"]["p99"], False),
    ("TPOT p99", "ms", lambda r: r["tpot_ms"]["p99"], False),
    ("goodput", "req/s", lambda r: r["goodput"], True),
    ("met SLO", "%", lambda r: _percent(r["slo_attainment"]), True),
)


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _short(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def slo_text(slo: dict[str, float | None]) -> str:
    parts = [f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in slo.items() if v]
    return " and ".join(parts) or "none given"


def verdict(
    label: str, unit: str, names: tuple[str, str], values: tuple[Any, Any], up: bool
) -> str:
    """One clause: who wins `label` and by how much (the higher value wins when `up`)."""
    va, vb = values
    if va is None or vb is None:
        return f"{label}: n/a"
    if max(va, vb) == 0 or abs(va - vb) <= TIE * max(va, vb):
        return f"{label}: tie ({_short(va)} vs {_short(vb)} {unit})"
    win = 0 if (va > vb) == up else 1
    ratio = f"{max(va, vb) / min(va, vb):.2g}x" if min(va, vb) > 0 else "only one is > 0"
    better = "higher" if up else "lower"
    pair = f"{_short(values[win])} vs {_short(values[1 - win])} {unit}"
    return f"{label}: **{names[win]}** ({pair}, {ratio} {better})"


def load_run(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "bench.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def render(runs: list[tuple[str, Path, dict[str, Any]]], out: Path, context: list[str]) -> str:
    first = runs[0][2]
    cfg = first["config"]
    lines = ["# Colocated vs disaggregated (1P1D) on the same cores", "", "## Setup", ""]
    lines += [f"- {line}" for line in context]
    lines += [
        f"- bench-serve: `{cfg['endpoint']}` endpoint, dataset `{cfg['dataset']}`, "
        f"{cfg['num_requests']} requests at {cfg['rate']} req/s ({cfg['arrival']}), "
        f"seed {cfg['seed']}; the same requests and arrival times for every deployment",
        f"- SLO for goodput: {slo_text(first['slo'])}",
        "",
        "## Results",
        "",
        "| deployment | " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    lines += [f"| {label} | " + " | ".join(f(r) for _, f in COLUMNS) + " |" for label, _, r in runs]
    names = (runs[0][0].split(" (")[0], runs[1][0].split(" (")[0])
    a, b = runs[0][2], runs[1][2]
    clauses = [verdict(lbl, unit, names, (f(a), f(b)), up) for lbl, unit, f, up in HEADLINES]
    lines += ["", "Reading: " + "; ".join(clauses) + ".", ""]
    failed = [f"{label}: {r['errors']['by_kind']}" for label, _, r in runs if r["failed"]]
    if failed:
        lines += ["Failed requests: " + "; ".join(failed) + ".", ""]
    lines += [
        "ITL pools every gap between streamed chunks of every request, so it is dominated by",
        "the short-prompt/long-output requests: their decode steps are what a long prefill",
        "on the same engine delays. TPOT is per request ((e2e - TTFT) / (tokens - 1)).",
        "",
        "## Plots",
        "",
        "![p50 and p99 side by side](compare.png)",
        "",
    ]
    for label, run_dir, _ in runs:
        for png in sorted(run_dir.glob("*.png")):
            rel = Path(os.path.relpath(png, out.parent)).as_posix()
            lines += [f"### {label}: {png.name}", "", f"![{label} {png.stem}]({rel})", ""]
    return "\n".join(lines)


def plot_comparison(runs: list[tuple[str, Path, dict[str, Any]]], path: Path) -> None:
    """p50 and p99 of TTFT, TPOT and ITL, one bar per deployment, each labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 4))
    width = 0.8 / len(runs)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for i, (label, _, run) in enumerate(runs):
            values = [run[key][p] or 0.0 for p in ("p50", "p99")]
            xs = [x + i * width for x in (0, 1)]
            bars = ax.bar(xs, values, width, label=label.split(" (")[0])
            ax.bar_label(bars, labels=[_short(v) for v in values], fontsize=8)
        ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in (0, 1)], ["p50", "p99"])
        ax.set_title(f"{title} (ms)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--colocated", type=Path, required=True, help="run dir of the baseline")
    p.add_argument("--disagg", type=Path, required=True, help="run dir of 1P1D")
    p.add_argument("--colocated-label", default="colocated (1 node, 2 threads on 2 cores)")
    p.add_argument("--disagg-label", default="1P1D (prefill, decode: 1 core each)")
    p.add_argument("--out", type=Path, required=True, help="the Markdown file to write")
    p.add_argument("--context", action="append", default=[], help="a setup line (repeatable)")
    args = p.parse_args(argv)
    try:
        runs = [
            (args.colocated_label, args.colocated, load_run(args.colocated)),
            (args.disagg_label, args.disagg, load_run(args.disagg)),
        ]
    except ValueError as e:
        print(f"compare_report: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_comparison(runs, args.out.parent / "compare.png")
    args.out.write_text(render(runs, args.out, args.context) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
