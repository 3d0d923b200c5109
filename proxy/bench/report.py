"""Presenting bench-serve runs: the summary table, a sweep table, PNG plots (Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from proxy.bench.stats import METRICS

TITLES = {
    "ttft_ms": "Time to first token",
    "tpot_ms": "Time per output token (excl. 1st)",
    "itl_ms": "Inter-token latency",
    "e2el_ms": "End-to-end latency",
}
WIDTH = 50


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def summary_table(summary: dict[str, Any], rate: float) -> str:
    """The run's numbers as a fixed-width text table (vLLM's layout)."""
    rows: list[tuple[str, str]] = [
        ("Request rate (req/s)", rate_label(rate)),
        ("Sent requests", str(summary["sent"])),
        ("Completed requests", str(summary["completed"])),
        ("Failed requests", str(summary["failed"])),
        ("  of which rejected (HTTP 503/429)", str(summary.get("rejected", 0))),
        ("Peak concurrent requests", str(summary["max_concurrent"])),
        ("Benchmark duration (s)", _num(summary["duration_s"])),
        ("Total input tokens", str(summary["total_input_tokens"])),
        ("Prefix cache hit rate", _num(summary["cache_hit_rate"])),
        ("Total output tokens", str(summary["total_output_tokens"])),
        ("Request throughput (req/s)", _num(summary["request_throughput"])),
        ("Output token throughput (tok/s)", _num(summary["output_token_throughput"])),
        ("Total token throughput (tok/s)", _num(summary["total_token_throughput"])),
        ("SLO attainment (share of sent)", _num(summary["slo_attainment"])),
        ("Goodput per run (SLO-met req/s)", _num(summary["goodput"])),
    ]
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines += [f"{k + ':':<38}{v:>12}" for k, v in rows]
    for metric in METRICS:
        lines.append(f" {TITLES[metric]} ".center(WIDTH, "-"))
        dist = summary[metric]
        short = metric.removesuffix("_ms").upper()
        for key in ("mean", "p50", "p90", "p99"):
            lines.append(f"{f'{key.capitalize()} {short} (ms):':<38}{_num(dist[key]):>12}")
    errors = summary["errors"]["by_kind"]
    if errors:
        lines.append(" Errors ".center(WIDTH, "-"))
        lines += [f"{kind + ':':<38}{count:>12}" for kind, count in errors.items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def sweep_table(runs: list[dict[str, Any]]) -> str:
    """One row per rate of a sweep."""
    head = (
        f"{'rate':>6} {'done':>5} {'fail':>5} {'rej':>5} {'req/s':>7} {'tok/s':>8} "
        f"{'SLO-met/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
    )
    lines = [head]
    for run in runs:
        ttft, itl = run["ttft_ms"], run["itl_ms"]
        lines.append(
            f"{rate_label(float(run['config']['rate'])):>6} {run['completed']:>5} "
            f"{run['failed']:>5} {run.get('rejected', 0):>5} {run['request_throughput']:>7.2f} "
            f"{run['output_token_throughput']:>8.1f} {_num(run['goodput']):>9} "
            f"{_num(ttft['p50'], '.1f'):>9} {_num(ttft['p99'], '.1f'):>9} "
            f"{_num(itl['p50'], '.1f'):>8} {_num(itl['p99'], '.1f'):>8}"
        )
    return "\n".join(lines)


def search_table(doc: dict[str, Any]) -> str:
    """A goodput search: one row per run (by rate), then the answer and what it means."""
    threshold = doc["attainment_threshold"]
    lines = [" Goodput search (DistServe) ".center(WIDTH + 20, "=")]
    lines.append(
        f"{'rate':>8} {'attain':>7} {'pass':>5} {'done':>5} {'sent':>5} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}"
    )
    for row in doc["curve"]:
        lines.append(
            f"{rate_label(row['rate']):>8} {row['attainment']:>7.0%} "
            f"{'yes' if row['passed'] else 'no':>5} {row['completed']:>5} {row['sent']:>5} "
            f"{_num(row['ttft_p50_ms'], '.1f'):>9} {_num(row['ttft_p99_ms'], '.1f'):>9} "
            f"{_num(row['tpot_p50_ms'], '.1f'):>9} {_num(row['tpot_p99_ms'], '.1f'):>9}"
        )
    slo = doc["slo"]
    lines += [
        "-" * (WIDTH + 20),
        f"Goodput (DistServe): {doc['goodput_distserve_rps']:g} req/s",
        f"  the highest rate with >= {threshold:.0%} of requests meeting TTFT <= "
        f"{slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms",
        f"  {doc['note']} ({doc['search']['runs_used']} runs, stopped: {doc['stop_reason']})",
        "=" * (WIDTH + 20),
    ]
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(samples: dict[str, list[float]], path: Path, title: str) -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2EL, one panel each."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, METRICS, strict=True):
        values = sorted(samples[metric])
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(TITLES[metric])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(runs: list[dict[str, Any]], path: Path) -> None:
    """p50 and p99 TTFT, ITL and TPOT against the offered request rate; with `inf` among the
    rates, against the achieved request throughput instead."""
    plt = _pyplot()
    rates = [float(run["config"]["rate"]) for run in runs]
    if any(math.isinf(r) for r in rates):
        xs, xlabel = [run["request_throughput"] for run in runs], "achieved request rate (req/s)"
    else:
        xs, xlabel = rates, "offered request rate (req/s)"
    order = sorted(range(len(runs)), key=lambda i: xs[i])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric in zip(axes, ("ttft_ms", "itl_ms", "tpot_ms"), strict=True):
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            pts = [(xs[i], runs[i][metric][pct]) for i in order]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=pct)
        ax.set_title(TITLES[metric])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing completed: no lines, no legend
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attainment(doc: dict[str, Any], path: Path) -> None:
    """SLO attainment against the offered rate, with the threshold line and the goodput."""
    plt = _pyplot()
    curve = doc["curve"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [row["rate"] for row in curve]
    ax.plot(xs, [100 * row["attainment"] for row in curve], "o-", label="attainment")
    for row in curve:
        ax.annotate(f"{row['rate']:g}", (row["rate"], 100 * row["attainment"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 4))  # fmt: skip
    threshold = 100 * doc["attainment_threshold"]
    ax.axhline(threshold, color="red", linestyle="--", label=f"threshold {threshold:.0f}%")
    goodput = doc["goodput_distserve_rps"]
    if goodput > 0:
        ax.axvline(goodput, color="green", linestyle=":", label=f"goodput {goodput:g} req/s")
    slo = doc["slo"]
    ax.set_title(
        f"SLO attainment (TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms)"
    )
    if xs and max(xs) / min(xs) > 4:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}"))
    save_attainment_plot(fig, ax, path)


def save_attainment_plot(fig: Any, ax: Any, path: Path) -> None:
    """An attainment-vs-rate plot's axes, legend and file (bench-serve's and the compare
    report's)."""
    plt = _pyplot()
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("requests meeting both (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
