"""Presenting bench-transfer records: Markdown table, goal ratios, PNG plot."""

from __future__ import annotations

from pathlib import Path

GOAL_BW_RATIO = 0.9  # nixl scattered vs bare single descriptor, 8b shape, >= 16 MiB
GOAL_BW_MIN_BYTES = 16 * 2**20
GOAL_LAT_RATIO = 1.5  # one-block p50, nixl vs bare
# One-block p50 of nixl minus bare NIXL's: what the layer's Python costs per write (issue 15)
GOAL_OVERHEAD_US = 30.0


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _bare(records: list[dict], label: str = "nixl-bare") -> dict[tuple[str, int], dict]:
    return {(r["shape"], r["num_blocks"]): r for r in records if r["backend"] == label}


def overhead_us(record: dict, bare: dict) -> float:
    """Per-write overhead over bare NIXL: the record's p50 minus bare's at the same point."""
    return float(record["p50_us"]) - float(bare["p50_us"])


def markdown_table(records: list[dict]) -> str:
    bare = _bare(records)
    head = (
        "| backend | shape | blocks | bytes | p50 µs | p99 µs | GB/s | memcpy GB/s "
        "| × memcpy | × nixl-bare | over bare µs | notify p50 µs |"
    )
    rows = [head, "|" + "---|" * 12]
    for r in sorted(records, key=lambda r: (r["shape"], r["backend"], r["num_blocks"])):
        b = bare.get((r["shape"], r["num_blocks"]))
        vs_bare = over = ""
        if b and r["backend"] != "nixl-bare":
            vs_bare, over = f"{r['gbps'] / b['gbps']:.2f}", f"{overhead_us(r, b):+.0f}"
        notify = r.get("recv_p50_us", "")
        rows.append(
            f"| {r['backend']} | {r['shape']} | {r['num_blocks']} | {_size(r['bytes'])} "
            f"| {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['gbps']:.2f} | {r['memcpy_gbps']:.2f} "
            f"| {r['gbps'] / r['memcpy_gbps']:.2f} | {vs_bare} | {over} | {notify} |"
        )
    return "\n".join(rows)


def goals(records: list[dict]) -> str:
    """The issues' goals, checked against this run's numbers."""
    bare, notified = _bare(records), _bare(records, "nixl-bare+notify")
    lines = ["Goals (nixl backend vs bare single-descriptor NIXL, same run):"]
    for r in (r for r in records if r["backend"] == "nixl"):
        b = bare.get((r["shape"], r["num_blocks"]))
        if b is None:
            continue
        if r["shape"] == "8b" and r["bytes"] >= GOAL_BW_MIN_BYTES:
            ratio = r["gbps"] / b["gbps"]
            verdict = "met" if ratio >= GOAL_BW_RATIO else "NOT met"
            lines.append(
                f"- bandwidth, 8b, {_size(r['bytes'])} scattered: {ratio:.2f}x bare "
                f"(goal >= {GOAL_BW_RATIO}x): {verdict}"
            )
        if r["num_blocks"] == 1:
            ratio = r["p50_us"] / b["p50_us"]
            verdict = "met" if ratio <= GOAL_LAT_RATIO else "NOT met"
            lines.append(
                f"- one-block p50, {r['shape']}: {r['p50_us']:.0f} vs {b['p50_us']:.0f} us = "
                f"{ratio:.2f}x bare (goal <= {GOAL_LAT_RATIO}x): {verdict}"
            )
            over = overhead_us(r, b)
            verdict = "met" if over <= GOAL_OVERHEAD_US else "NOT met"
            lines.append(
                f"- per-write overhead, one block, {r['shape']}: {r['p50_us']:.0f} - "
                f"{b['p50_us']:.0f} us = {over:.0f} us over bare (goal <= "
                f"{GOAL_OVERHEAD_US:.0f} us): {verdict}"
            )
            bn = notified.get((r["shape"], r["num_blocks"]))
            if bn is not None:
                lines.append(
                    f"  (bare + one zmq notification: {bn['p50_us']:.0f} us, so telling the "
                    f"receiver alone costs {overhead_us(bn, b):.0f} us; the layer's own "
                    f"overhead beyond that: {overhead_us(r, bn):.0f} us)"
                )
    if len(lines) == 1:
        lines.append("- (needs the nixl backend in the run)")
    return "\n".join(lines)


def write_plot(records: list[dict], path: Path) -> None:
    """Bandwidth vs transfer size, one panel per shape, one line per backend, memcpy dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in records})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        mine = [r for r in records if r["shape"] == shape]
        for backend in sorted({r["backend"] for r in mine}):
            pts = sorted((r["bytes"], r["gbps"]) for r in mine if r["backend"] == backend)
            style = ":" if backend == "nixl-bare" else "-"
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=backend)
        ceiling: dict[int, list[float]] = {}
        for r in mine:
            ceiling.setdefault(r["bytes"], []).append(r["memcpy_gbps"])
        pts = sorted((b, max(v)) for b, v in ceiling.items())
        ax.plot(*zip(*pts, strict=True), "--", color="gray", label="memcpy (ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per transfer")
        ax.set_ylabel("GB/s (p50)")
        ax.set_title(f"KV transfer, {shape} shape")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
