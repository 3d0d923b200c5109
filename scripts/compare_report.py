"""Markdown report of a colocated vs disaggregated comparison (`scripts/compare_disagg.sh`).

Each run directory holds one `pdserve bench-serve` result (`bench.json`) and its plots
(`*.png` from `--plot-dir`). The report: the setup (the model and the objectives included),
one table row per deployment (TTFT, TPOT and ITL p50/p99, throughput, the share of requests
meeting the SLOs and SLO-met requests/s at the run's one rate), one line on who wins each
headline number, a bar chart of the p50/p99s side by side (`compare.png` beside the report)
and each run's plots, linked relative to the report.

Where the run directories also hold a goodput search (`goodput/search.json`, from
`bench-serve --goodput-search`; all of them or none), a section on goodput as DistServe
defines it: per deployment the highest rate at which >= 90% of requests met both the TTFT
and the TPOT objective, its bracket and attainment curve, who wins, and both curves in one
plot (`goodput.png` beside the report).

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
SEARCH_FILE = Path("goodput") / "search.json"
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
    ("SLO-met req/s", lambda r: _num(r["goodput"])),
    ("met SLO", lambda r: _pct(r["slo_attainment"])),
)
# (label, unit, how to read it from a run, higher is better)
HEADLINES = (
    ("decode ITL p99", "ms", lambda r: r["itl_ms"]["p99"], False),
    ("TTFT p50", "ms", lambda r: r["ttft_ms"]["p50"], False),
    ("TTFT p99", "ms", lambda r: r["ttft_ms"]["p99"], False),
    ("TPOT p99", "ms", lambda r: r["tpot_ms"]["p99"], False),
    ("SLO-met req/s", "req/s", lambda r: r["goodput"], True),
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
    better = "higher" if up else "lower"
    ratio = f"{max(va, vb) / min(va, vb):.2g}x {better}" if min(va, vb) > 0 else "the other is 0"
    pair = f"{_short(values[win])} vs {_short(values[1 - win])} {unit}"
    return f"{label}: **{names[win]}** ({pair}, {ratio})"


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def load_run(run_dir: Path) -> dict[str, Any]:
    return _load(run_dir / "bench.json")


def load_searches(run_dirs: list[Path]) -> list[dict[str, Any]] | None:
    """Each run directory's goodput search, or None when none has one."""
    paths = [d / SEARCH_FILE for d in run_dirs]
    present = [p for p in paths if p.exists()]
    if not present:
        return None
    if len(present) != len(paths):
        missing = ", ".join(str(p) for p in paths if not p.exists())
        raise ValueError(f"a goodput search for some deployments only: no {missing}")
    return [_load(p) for p in paths]


def render(
    runs: list[tuple[str, Path, dict[str, Any]]],
    out: Path,
    context: list[str],
    searches: list[dict[str, Any]] | None = None,
) -> str:
    first = runs[0][2]
    cfg = first["config"]
    lines = ["# Colocated vs disaggregated (1P1D) on the same cores", "", "## Setup", ""]
    lines += [f"- model: `{cfg['model']}` (as the server names it)"]
    lines += [f"- {line}" for line in context]
    lines += [
        f"- bench-serve: `{cfg['endpoint']}` endpoint, dataset `{cfg['dataset']}`, "
        f"{cfg['num_requests']} requests at {cfg['rate']} req/s ({cfg['arrival']}), "
        f"seed {cfg['seed']}; the same requests and arrival times for every deployment",
        f'- objectives (SLOs): {slo_text(first["slo"])}; "met SLO" is the share of sent '
        'requests meeting them, "SLO-met req/s" those requests per second of the run',
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
    ]
    if searches is not None:
        labels = [label for label, _, _ in runs]
        lines += render_goodput(labels, searches)
    lines += ["## Plots", "", "![p50 and p99 side by side](compare.png)", ""]
    for label, run_dir, _ in runs:
        for png in sorted(run_dir.glob("*.png")):
            rel = Path(os.path.relpath(png, out.parent)).as_posix()
            lines += [f"### {label}: {png.name}", "", f"![{label} {png.stem}]({rel})", ""]
    return "\n".join(lines)


def _curve_text(search: dict[str, Any]) -> str:
    return ", ".join(f"{row['rate']:g}: {row['attainment']:.0%}" for row in search["curve"])


def render_goodput(labels: list[str], searches: list[dict[str, Any]]) -> list[str]:
    """The goodput (DistServe) section: objectives, one row per deployment, who wins."""
    first = searches[0]
    slo, threshold, search = first["slo"], first["attainment_threshold"], first["search"]
    share, model = f"{threshold:.0%}", first["config"]["model"]
    if any(s["slo"] != slo or s["attainment_threshold"] != threshold for s in searches):
        raise ValueError("the deployments' goodput searches used different objectives")
    lines = [
        "## Goodput (DistServe)",
        "",
        f"Model `{model}`. Objectives: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= "
        f"{slo['tpot_ms']:g} ms, met by at least {share} of the requests (a failed request is "
        "a miss; a one-token output is judged on its TTFT alone). Goodput is the highest "
        "offered rate at which a run met them, found by a bounded search over runs of the "
        f"same {first['config']['num_requests']} requests: from {search['start_rate']:g} "
        f"req/s, doubling while runs pass (halving while they fail), then bisecting to a "
        f"relative tolerance of {search['tolerance']:g}, at most {search['max_runs']} runs.",
        "",
        "| deployment | goodput (DistServe) req/s | passed / failed at | runs | attainment by "
        "rate (req/s: share) |",
        "|---|---:|---|---:|---|",
    ]
    for label, s in zip(labels, searches, strict=True):
        bracket = f"{_rate(s['highest_passing_rate'])} / {_rate(s['lowest_failing_rate'])}"
        lines.append(
            f"| {label} | {s['goodput_distserve_rps']:g} | {bracket} | "
            f"{s['search']['runs_used']} | {_curve_text(s)} |"
        )
    names = (labels[0].split(" (")[0], labels[1].split(" (")[0])
    values = (searches[0]["goodput_distserve_rps"], searches[1]["goodput_distserve_rps"])
    lines += ["", "Reading: " + verdict("goodput (DistServe)", "req/s", names, values, True) + "."]
    lines += [f"- {label}: {s['note']}." for label, s in zip(labels, searches, strict=True)]
    lines += ["", "![SLO attainment against the offered rate](goodput.png)", ""]
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def plot_goodput(labels: list[str], searches: list[dict[str, Any]], path: Path) -> None:
    """Each deployment's attainment curve, the threshold and each goodput, in one plot."""
    import matplotlib

    from proxy.bench.report import save_attainment_plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, search in zip(labels, searches, strict=True):
        xs = [row["rate"] for row in search["curve"]]
        line = ax.plot(xs, [100 * row["attainment"] for row in search["curve"]], "o-")[0]
        line.set_label(f"{label.split(' (')[0]}: {search['goodput_distserve_rps']:g} req/s")
        if search["goodput_distserve_rps"] > 0:
            ax.axvline(search["goodput_distserve_rps"], color=line.get_color(), linestyle=":")
    threshold = 100 * searches[0]["attainment_threshold"]
    ax.axhline(threshold, color="red", linestyle="--", label=f"threshold {threshold:.0f}%")
    slo = searches[0]["slo"]
    ax.set_title(f"TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms")
    save_attainment_plot(fig, ax, path)


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
        searches = load_searches([args.colocated, args.disagg])
        text = render(runs, args.out, args.context, searches)
    except ValueError as e:
        print(f"compare_report: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_comparison(runs, args.out.parent / "compare.png")
    if searches is not None:
        labels = [args.colocated_label, args.disagg_label]
        plot_goodput(labels, searches, args.out.parent / "goodput.png")
    args.out.write_text(text + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
