"""Markdown report of a colocated vs disaggregated comparison (`scripts/compare_disagg.sh`).

Each run is one deployment, given as `--run KIND:LABEL=DIR`: KIND is `colocated` or
`disagg` (which side of the goal below the run counts on), LABEL its name in the report, DIR
its directory, holding one `pdserve bench-serve` result (`bench.json`) and its plots (`*.png`
from `--plot-dir`). Any number of runs, in the order given; `--colocated DIR` and `--disagg
DIR` are shorthands for one run of each kind (labels `--colocated-label`, `--disagg-label`).

The report: the setup (the model and the objectives included); the goal line (below); one
table row per deployment (TTFT, TPOT and ITL p50/p99, throughput, the share of requests
meeting the SLOs and SLO-met requests/s at the run's one rate); one line on who wins each
headline number; a bar chart of every deployment's p50/p99s (`compare.png` beside the
report) and each run's plots, linked relative to the report.

Where the run directories also hold a goodput search (`goodput/search.json`, from
`bench-serve --goodput-search`; all of them or none), a section on goodput as DistServe
defines it: per deployment the highest rate at which >= 90% of requests met both the TTFT
and the TPOT objective, its bracket and attainment curve, who wins, and every curve in one
plot (`goodput.png` beside the report).

Where a run directory holds the proxy's metrics scraped after the warm-up, the fixed-rate run
and the search (`metrics-warm.txt`, `metrics-bench.txt`, `metrics-search.txt`), a table of
where the proxy placed each prompt in the fixed-rate run and in the search (conditional
disaggregation: on the prefill pool or locally on a decode node, by the decision's reason).

Where a run directory holds a speed probe (`speed-probe.json`: `scripts/bench_engine.py
--json` on one thread, which `compare_disagg.sh` runs before starting each deployment), a
section on the machine's speed: each probe's decode and prefill tokens/s and the spread
between the slowest and the fastest, which the goal section repeats. A shared machine's
speed drifts; two deployments that differ by less than that spread differ by the machine.

With `--capacity FILE` (`scripts/workload_capacity.py --json`, which `compare_disagg.sh` runs
once before the first deployment: the engine offline on one thread serving the workload's
requests all at once, no latency objective), a section on the machine's capacity: that
throughput times `--capacity-cores` is a ceiling no deployment on those cores sustains, and
each goodput is given as a share of it; the goal section repeats the ceiling over the better
colocated goodput (the most any deployment could reach over it on this machine), not judged.

The goal (issue 15): the best disaggregated run's goodput (DistServe) at least
`--goal-goodput-ratio` (1.5) times the better colocated run's, and its decode ITL p99 (from
the fixed-rate run) at most `--goal-itl-ratio` (0.5) times that colocated run's. "Best" and
"better" are by goodput, a tie going to the lower ITL p99. The report states both ratios
with their numbers, each met, not met or not judged, and the goal met, not met, or not
judged (no goodput search, no run of one kind, or a goodput that is only a lower bound, its
search never having failed a run, where that leaves the ratio undecided). Beside them, not
judged, the ITL p99 ratio under load: at the colocated run's goodput rate (its busiest
passing search run) against the disaggregated run's search run at that rate or the next
above it, since the light fixed-rate run rarely has a prefill stall to show.

    python scripts/compare_report.py --run colocated:colocated-1x2=out/compare/colocated-1x2 \\
        --run disagg:1p1d-auto=out/compare/1p1d-auto --out out/compare/report.md \\
        --context "rate 1 req/s"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.bench.stats import distribution

TIE = 0.05  # relative difference under which runs tie
KINDS = ("colocated", "disagg")
SEARCH_FILE = Path("goodput") / "search.json"
PROBE_FILE = Path("speed-probe.json")
# The proxy's /metrics scraped by compare_disagg.sh: after the warm-up, after the fixed-rate
# run, after the goodput search
SCRAPES = ("metrics-warm.txt", "metrics-bench.txt", "metrics-search.txt")
PLACEMENTS = "pdserve_proxy_placements_total"
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


@dataclass(frozen=True)
class RunSpec:
    """One `--run KIND:LABEL=DIR`."""

    kind: str
    label: str
    dir: Path

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a run's kind is one of {', '.join(KINDS)}, not {self.kind!r}")
        if not self.label or "|" in self.label:
            raise ValueError(f"a run's label must be non-empty, without '|': {self.label!r}")


@dataclass(frozen=True)
class Run:
    """One deployment's results: its fixed-rate run and, with --goodput, its search."""

    spec: RunSpec
    bench: dict[str, Any]
    search: dict[str, Any] | None
    probe: dict[str, Any] | None = None  # the machine's speed before the run, if probed

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def itl_p99(self) -> float | None:
        return self.bench["itl_ms"]["p99"]


@dataclass(frozen=True)
class Goal:
    """Issue 15's goal: best disaggregated / better colocated goodput and ITL p99 bounds."""

    goodput_ratio: float = 1.5  # at least
    itl_ratio: float = 0.5  # at most

    def __post_init__(self) -> None:
        if self.goodput_ratio <= 0 or self.itl_ratio <= 0:
            raise ValueError("the goal's ratios must be > 0")


def run_spec(text: str) -> RunSpec:
    """Parse `KIND:LABEL=DIR` (argparse's type for --run)."""
    head, eq, path = text.partition("=")
    kind, colon, label = head.partition(":")
    if not (eq and colon and path):
        raise argparse.ArgumentTypeError(f"expected KIND:LABEL=DIR, got {text!r}")
    try:
        return RunSpec(kind, label, Path(path))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TIE * max(abs(a), abs(b))


def verdict(label: str, unit: str, values: Sequence[tuple[str, float | None]], up: bool) -> str:
    """One clause: which run wins `label` (the highest value when `up`) over the next best and
    by how much, or which runs tie for it (within TIE of the best); runs without a value are
    left out."""
    known = [(name, v) for name, v in values if v is not None]
    if len(known) < 2:
        return f"{label}: n/a"
    ranked = sorted(known, key=lambda nv: nv[1], reverse=up)
    (best, bv), (nxt, nv) = ranked[0], ranked[1]
    if _close(bv, nv):
        tied = ", ".join(f"{name} {_short(v)}" for name, v in ranked if _close(bv, v))
        return f"{label}: tie ({tied} {unit})"
    better = "higher" if up else "lower"
    ratio = f", {max(bv, nv) / min(bv, nv):.2g}x {better}" if min(bv, nv) > 0 else ""
    return f"{label}: **{best}** ({_short(bv)} {unit}; next {nxt} {_short(nv)} {unit}{ratio})"


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def load_runs(specs: list[RunSpec]) -> list[Run]:
    """Each run's bench.json and goodput search (all of them or none may have one)."""
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two runs share a label: {', '.join(labels)}")
    paths = [s.dir / SEARCH_FILE for s in specs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing and len(missing) != len(paths):
        raise ValueError(f"a goodput search for some deployments only: no {', '.join(missing)}")
    return [
        Run(s, _load(s.dir / "bench.json"), None if missing else _load(p), _probe(s.dir))
        for s, p in zip(specs, paths, strict=True)
    ]


def _probe(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / PROBE_FILE
    return _load(path) if path.exists() else None


def _probe_rate(probe: dict[str, Any], what: str) -> tuple[int, float] | None:
    """(size, pdserve tokens/s) of the probe's first `what` row ("decode" or "prefill")."""
    for row in probe.get("rows", []):
        if row.get("what") == what and math.isfinite(row.get("pdserve_tok_s", math.nan)):
            return int(row["size"]), float(row["pdserve_tok_s"])
    return None


def speed_spread(runs: list[Run], what: str) -> float | None:
    """How far the slowest probe's `what` rate is below the fastest's (0.1: 10% slower);
    None with fewer than two probes."""
    rates = [r[1] for run in runs if run.probe and (r := _probe_rate(run.probe, what))]
    return None if len(rates) < 2 else 1 - min(rates) / max(rates)


def _spread_text(runs: list[Run]) -> str | None:
    """ "decode 5%, prefill 3%": the slowest probe below the fastest; None below two probes."""
    parts = [
        f"{what} {spread:.0%}"
        for what in ("decode", "prefill")
        if (spread := speed_spread(runs, what)) is not None
    ]
    return ", ".join(parts) or None


def _speed_lines(runs: list[Run]) -> list[str]:
    probed = [run for run in runs if run.probe is not None]
    if not probed:
        return []
    first = probed[0].probe or {}
    lines = [
        "## Machine speed",
        "",
        f"Before each deployment started, with nothing else of the comparison running: "
        f"pdserve's engine offline (`scripts/bench_engine.py`), {first.get('dtype', '?')}, "
        f"{first.get('threads', '?')} thread(s) pinned to the first core. A shared machine's "
        "speed drifts; deployments that differ by less than the spread below may differ only "
        "by the machine.",
        "",
        "| deployment | decode tok/s | prefill tok/s |",
        "|---|---:|---:|",
    ]
    for run in probed:
        cells = []
        for what in ("decode", "prefill"):
            got = _probe_rate(run.probe or {}, what)
            cells.append("-" if got is None else f"{got[1]:.1f} ({what} {got[0]})")
        lines.append(f"| {run.label} | {cells[0]} | {cells[1]} |")
    spread = _spread_text(runs)
    lines += ["", f"Spread, the slowest probe below the fastest: {spread or '-'}."]
    if missing := [run.label for run in runs if run.probe is None]:
        lines[-1] += f" Not probed: {', '.join(missing)}."
    return lines + [""]


def _speed_under_goal(runs: list[Run]) -> list[str]:
    if (spread := _spread_text(runs)) is None:
        return []
    return [
        f"- not judged, the machine's speed: the slowest speed probe below the fastest by "
        f"{spread} (see Machine speed)"
    ]


@dataclass(frozen=True)
class Capacity:
    """The workload's throughput ceiling: one engine thread's offline requests/s, and the
    cores the deployments' nodes share."""

    doc: dict[str, Any]
    cores: int

    @property
    def per_core(self) -> float:
        return float(self.doc["requests_per_s"])

    @property
    def ceiling(self) -> float:
        return self.per_core * self.cores


def load_capacity(path: Path | None, cores: int) -> Capacity | None:
    if path is None:
        return None
    if cores < 1:
        raise ValueError(f"--capacity-cores must be >= 1, got {cores}")
    doc = _load(path)
    rps = doc.get("requests_per_s")
    if not isinstance(rps, int | float) or not math.isfinite(rps) or rps <= 0:
        raise ValueError(f"{path}: no positive requests_per_s")
    return Capacity(doc, cores)


def _capacity_lines(runs: list[Run], capacity: Capacity | None) -> list[str]:
    if capacity is None:
        return []
    doc = capacity.doc
    lines = [
        "## Machine capacity",
        "",
        f"Before the first deployment, with nothing else of the comparison running: pdserve's "
        f"engine offline (`scripts/workload_capacity.py`), {doc.get('dtype', '?')}, "
        f"{doc.get('threads', '?')} thread(s) pinned to the first core, served "
        f"{doc.get('requests', '?')} of the workload's requests ({doc.get('prompt_tokens', '?')} "
        f"prompt and {doc.get('output_tokens', '?')} output tokens) all at once, with no latency "
        f"objective, in {float(doc.get('wall_s', math.nan)):.1f} s: "
        f"**{capacity.per_core:.2f} req/s per core**. No deployment on the nodes' "
        f"{capacity.cores} cores sustains more than {capacity.cores} x that, "
        f"**{capacity.ceiling:.2f} req/s**, however it places the work (the proxy and the "
        "client take some of the same cores); one held to latency objectives sustains less, "
        "since its queues must stay short.",
        "",
    ]
    if runs[0].search is None:
        return lines
    lines += [
        "| deployment | goodput (DistServe) req/s | share of the ceiling |",
        "|---|---:|---:|",
    ]
    for run in runs:
        g = _goodput(run)
        lines.append(f"| {run.label} | {g:g} | {g / capacity.ceiling:.0%} |")
    return lines + [""]


def _capacity_under_goal(d: Run, c: Run, capacity: Capacity | None) -> list[str]:
    if capacity is None or not _goodput(c) > 0:
        return []
    ceiling = capacity.ceiling
    return [
        f"- not judged, the machine's ceiling: {ceiling:.2f} req/s (see Machine capacity) / "
        f"{c.label} {_goodput(c):g} req/s = {ceiling / _goodput(c):.2f}x, the most any "
        f"deployment could reach over {c.label} on this machine; {d.label} reached "
        f"{_goodput(d) / ceiling:.0%} of the ceiling, {c.label} {_goodput(c) / ceiling:.0%}"
    ]


def _setup_lines(runs: list[Run], context: list[str]) -> list[str]:
    first = runs[0].bench
    cfg = first["config"]
    lines = ["# Colocated vs disaggregated on the same cores", "", "## Setup", ""]
    lines += [f"- model: `{cfg['model']}` (as the server names it)"]
    lines += [f"- {line}" for line in context]
    lines += [
        f"- bench-serve: `{cfg['endpoint']}` endpoint, dataset `{cfg['dataset']}`, "
        f"{cfg['num_requests']} requests at {cfg['rate']} req/s ({cfg['arrival']}), "
        f"seed {cfg['seed']}; the same requests and arrival times for every deployment",
        f'- objectives (SLOs): {slo_text(first["slo"])}; "met SLO" is the share of sent '
        'requests meeting them, "SLO-met req/s" those requests per second of the run',
        "",
    ]
    return lines


def _results_lines(runs: list[Run]) -> list[str]:
    lines = [
        "## Results",
        "",
        "| deployment | kind | " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for run in runs:
        cells = " | ".join(f(run.bench) for _, f in COLUMNS)
        lines.append(f"| {run.label} | {run.spec.kind} | {cells} |")
    clauses = [
        verdict(name, unit, [(r.label, f(r.bench)) for r in runs], up)
        for name, unit, f, up in HEADLINES
    ]
    lines += ["", "Reading: " + "; ".join(clauses) + ".", ""]
    failed = [f"{r.label}: {r.bench['errors']['by_kind']}" for r in runs if r.bench["failed"]]
    if failed:
        lines += ["Failed requests: " + "; ".join(failed) + ".", ""]
    lines += [
        "ITL pools every gap between streamed chunks of every request, so it is dominated by",
        "the short-prompt/long-output requests: their decode steps are what a long prefill",
        "on the same engine delays. TPOT is per request ((e2e - TTFT) / (tokens - 1)).",
        "",
    ]
    return lines


def placements(text: str) -> dict[tuple[str, str], float]:
    """(placement, reason) -> count, from the proxy's Prometheus text."""
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith(PLACEMENTS + "{"):
            continue
        labels, _, value = line[len(PLACEMENTS) + 1 :].rpartition("} ")
        pairs = dict(part.split("=", 1) for part in labels.split(",") if "=" in part)
        key = (pairs.get("placement", "").strip('"'), pairs.get("reason", "").strip('"'))
        counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def placements_between(before: str, after: str) -> dict[tuple[str, str], int]:
    """The placements counted between two scrapes, those that happened only."""
    start, end = placements(before), placements(after)
    return {k: int(v - start.get(k, 0.0)) for k, v in sorted(end.items()) if v > start.get(k, 0.0)}


def _placement_text(counts: dict[tuple[str, str], int]) -> str:
    if not counts:
        return "-"
    parts = []
    for where in ("remote", "local"):
        mine = {r: n for (p, r), n in counts.items() if p == where}
        if mine:
            reasons = ", ".join(f"{r} {n}" for r, n in mine.items())
            parts.append(f"{where} {sum(mine.values())} ({reasons})")
    return "; ".join(parts)


def _placement_lines(runs: list[Run]) -> list[str]:
    rows = []
    for run in runs:
        warm, bench, search = (run.spec.dir / name for name in SCRAPES)
        if not (warm.exists() and bench.exists()):
            continue
        fixed = placements_between(warm.read_text(), bench.read_text())
        searched = "-"
        if search.exists():
            searched = _placement_text(placements_between(bench.read_text(), search.read_text()))
        if fixed or search.exists():
            rows.append(f"| {run.label} | {_placement_text(fixed)} | {searched} |")
    if not rows:
        return []
    return [
        "Where the proxy prefilled each prompt (`pdserve_proxy_placements_total`): on the "
        "prefill pool (remote) or on the decode node (local), by the decision's reason, in "
        "the fixed-rate run and in all the search's runs together.",
        "",
        "| deployment | fixed-rate run | goodput search |",
        "|---|---|---|",
        *rows,
        "",
    ]


def itl_split(bench: dict[str, Any]) -> dict[str, Any] | None:
    """Where the ITL tail is, from `--save-detailed` records: each request's first gap (its
    first token to its second: on a disaggregated deployment the hand-off from the prefill
    node to the decode node) apart from its later gaps (decode steps), and how many of the
    gaps at or above the pooled p99 are first gaps. None without the records."""
    records = [r for r in bench.get("requests") or [] if r["ok"] and r["itl_ms"]]
    if not records:
        return None
    first = distribution([r["itl_ms"][0] for r in records])
    later = distribution([g for r in records for g in r["itl_ms"][1:]])
    pooled = bench["itl_ms"]["p99"]
    tail = [(i == 0) for r in records for i, g in enumerate(r["itl_ms"]) if g >= pooled]
    n_later = sum(len(r["itl_ms"]) - 1 for r in records)
    return {
        "first_p50": first["p50"],
        "first_p99": first["p99"],
        "later_p50": later["p50"],
        "later_p99": later["p99"],
        "tail": len(tail),
        "tail_first": sum(tail),
        "gaps": len(records) + n_later,
    }


def _itl_split_lines(runs: list[Run]) -> list[str]:
    splits = [(run, itl_split(run.bench)) for run in runs]
    if not any(split for _, split in splits):
        return []
    lines = [
        "Where the ITL tail is (fixed-rate run, from each request's record): its first gap, "
        "first token to second (on 1P1D the hand-off: KV lands, the decode node admits at a "
        "step boundary, then runs a step), apart from its later gaps (decode steps), p50 / p99 "
        "in ms; and of the gaps at or above the pooled ITL p99, how many are first gaps.",
        "",
        "| deployment | first gap p50 / p99 | later gaps p50 / p99 | gaps >= ITL p99: first gaps |",
        "|---|---:|---:|---:|",
    ]
    for run, split in splits:
        if split is None:
            lines.append(f"| {run.label} | - | - | - |")
            continue
        lines.append(
            f"| {run.label} | {_ms(split['first_p50'])} / {_ms(split['first_p99'])} | "
            f"{_ms(split['later_p50'])} / {_ms(split['later_p99'])} | "
            f"{split['tail_first']} of {split['tail']} (of {split['gaps']} gaps) |"
        )
    return [*lines, ""]


def render(
    runs: list[Run],
    out: Path,
    context: list[str],
    goal: Goal | None = None,
    capacity: Capacity | None = None,
) -> str:
    lines = _setup_lines(runs, context)
    lines += render_goal(runs, goal or Goal(), capacity)
    lines += _speed_lines(runs)
    lines += _capacity_lines(runs, capacity)
    lines += _results_lines(runs)
    lines += _itl_split_lines(runs)
    lines += _placement_lines(runs)
    if runs[0].search is not None:
        lines += render_goodput(runs)
    lines += ["## Plots", "", "![p50 and p99 of every deployment](compare.png)", ""]
    for run in runs:
        for png in sorted(run.spec.dir.glob("*.png")):
            rel = Path(os.path.relpath(png, out.parent)).as_posix()
            lines += [f"### {run.label}: {png.name}", "", f"![{run.label} {png.stem}]({rel})", ""]
    return "\n".join(lines)


def _goodput(run: Run) -> float:
    assert run.search is not None
    return run.search["goodput_distserve_rps"]


def _best(runs: list[Run]) -> Run:
    """The run with the highest goodput; of equal ones, the lowest ITL p99."""

    def key(run: Run) -> tuple[float, float]:
        itl = run.itl_p99
        return _goodput(run), -(math.inf if itl is None else itl)

    return max(runs, key=key)


def _check(num: float | None, den: float | None, bound: float, at_least: bool) -> tuple[str, str]:
    """(num / den as text, "met" | "not met" | "not judged") against `bound`."""
    if num is None or den is None:
        return "n/a", "not judged"
    ratio = num / den if den else (math.inf if num > 0 else math.nan)
    # A ratio on the bound is on it: 2.4 / 1.6 is 1.4999999999999998 in binary floating point,
    # and the rates are decimal search steps, so compare within a rounding error of the bound.
    on_bound = math.isfinite(ratio) and math.isclose(ratio, bound, rel_tol=1e-9)
    met = on_bound or (ratio >= bound if at_least else ratio <= bound)
    text = f"{ratio:.2f}x" if math.isfinite(ratio) else "no finite ratio"
    return text, "met" if met else "not met"


def _lower_bound(run: Run) -> bool:
    """Whether the run's goodput is only a lower bound: its search never failed a run."""
    assert run.search is not None
    return run.search["lowest_failing_rate"] is None and _goodput(run) > 0


def _goodput_check(d: Run, c: Run, goal: Goal) -> tuple[str, str]:
    """(the goodput line, its verdict). A lower bound decides nothing, except a disaggregated
    one already past the bound against a colocated goodput that is not one."""
    text, met = _check(_goodput(d), _goodput(c), goal.goodput_ratio, at_least=True)
    line = f"- goodput: {d.label} {_goodput(d):g} req/s / {c.label} {_goodput(c):g} req/s = {text}"
    bounded = [r.label for r in (d, c) if _lower_bound(r)]
    if _lower_bound(c) or (_lower_bound(d) and met == "not met"):
        met = "not judged"
        what = "lower bounds" if len(bounded) > 1 else "a lower bound"
        why = f"; {' and '.join(bounded)}: {what} only (no search run failed)"
        return f"{line} (>= {goal.goodput_ratio:g}x: {met}{why})", met
    return f"{line} (>= {goal.goodput_ratio:g}x: {met})", met


def render_goal(runs: list[Run], goal: Goal, capacity: Capacity | None = None) -> list[str]:
    """Issue 15's goal line: the two ratios, each met or not, and the goal as a whole."""
    lines = [
        "## Goal",
        "",
        f"Goal (issue 15): the best disaggregated deployment's goodput (DistServe) >= "
        f"{goal.goodput_ratio:g}x the better colocated deployment's, with its decode ITL p99 "
        f"<= {goal.itl_ratio:g}x that colocated deployment's (best and better by goodput, a "
        "tie going to the lower ITL p99; ITL p99 from the fixed-rate run).",
        "",
    ]
    colocated = [r for r in runs if r.spec.kind == "colocated"]
    disagg = [r for r in runs if r.spec.kind == "disagg"]
    if not colocated or not disagg:
        return lines + ["**Goal not judged**: it needs a colocated and a disaggregated run.", ""]
    if runs[0].search is None:
        why = "it needs each deployment's goodput search (`compare_disagg.sh --goodput`)"
        return lines + [f"**Goal not judged**: {why}.", ""]
    d, c = _best(disagg), _best(colocated)
    g_line, g_met = _goodput_check(d, c, goal)
    i_text, i_met = _check(d.itl_p99, c.itl_p99, goal.itl_ratio, at_least=False)
    verdicts = {g_met, i_met}
    overall = "not met" if "not met" in verdicts else "met" if verdicts == {"met"} else "not judged"
    lines += [
        g_line,
        f"- decode ITL p99: {d.label} {_ms(d.itl_p99)} / {c.label} {_ms(c.itl_p99)} = "
        f"{i_text} (<= {goal.itl_ratio:g}x: {i_met})",
        *_itl_under_load(d, c),
        *_speed_under_goal(runs),
        *_capacity_under_goal(d, c, capacity),
        "",
        f"**Goal {overall}** ({d.label} against {c.label}).",
        "",
    ]
    return lines


def _search_run_at(run: Run, rate: float, at_least: bool) -> dict[str, Any] | None:
    """The run's search run at `rate`, else (at_least) the lowest rate above it it ran."""
    assert run.search is not None
    runs = sorted(run.search.get("runs", []), key=lambda r: float(r["config"]["rate"]))
    for r in runs:
        ran = float(r["config"]["rate"])
        if _close(ran, rate) or (at_least and ran > rate):
            return r
    return None


def _itl_under_load(d: Run, c: Run) -> list[str]:
    """Not judged: the same ratio at the colocated deployment's goodput rate (its busiest
    passing run), against the disaggregated one's run at that rate or the next above it
    (at least as loaded). The fixed-rate run is light; prefill stalls show under load."""
    rate = c.search["highest_passing_rate"] if c.search is not None else None
    if rate is None:
        return []
    c_run, d_run = _search_run_at(c, rate, False), _search_run_at(d, rate, True)
    if c_run is None or d_run is None:
        return []
    c_itl, d_itl = c_run["itl_ms"]["p99"], d_run["itl_ms"]["p99"]
    text, _ = _check(d_itl, c_itl, 1.0, at_least=False)
    d_rate = float(d_run["config"]["rate"])
    return [
        f"- not judged, under load: decode ITL p99 at {c.label}'s goodput rate ({rate:g} "
        f"req/s): {d.label} {_ms(d_itl)} (at {d_rate:g} req/s) / {c.label} {_ms(c_itl)} = "
        f"{text}"
    ]


def _curve_text(search: dict[str, Any]) -> str:
    return ", ".join(f"{row['rate']:g}: {row['attainment']:.0%}" for row in search["curve"])


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def render_goodput(runs: list[Run]) -> list[str]:
    """The goodput (DistServe) section: objectives, one row per deployment, who wins."""
    searches = [r.search for r in runs if r.search is not None]
    first = searches[0]
    slo, threshold, search = first["slo"], first["attainment_threshold"], first["search"]
    share, model = f"{threshold:.0%}", first["config"]["model"]
    config = first["config"]
    if config.get("num_requests") is None and config.get("duration_s"):
        cap = config.get("max_concurrency")
        sized = f"runs offering each rate for {config['duration_s']:g} s" + (
            f" (at most {cap} requests in flight)" if cap else " (open loop)"
        )
    else:
        sized = f"runs of the same {config.get('num_requests')} requests"
    if any(s["slo"] != slo or s["attainment_threshold"] != threshold for s in searches):
        raise ValueError("the deployments' goodput searches used different objectives")
    lines = [
        "## Goodput (DistServe)",
        "",
        f"Model `{model}`. Objectives: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= "
        f"{slo['tpot_ms']:g} ms, met by at least {share} of the requests (a failed request is "
        "a miss; a one-token output is judged on its TTFT alone). Goodput is the highest "
        f"offered rate at which a run met them, found by a bounded search over {sized}: "
        f"from {search['start_rate']:g} "
        f"req/s, doubling while runs pass (halving while they fail), then bisecting to a "
        f"relative tolerance of {search['tolerance']:g}, at most {search['max_runs']} runs.",
        "",
        "| deployment | kind | goodput (DistServe) req/s | passed / failed at | runs | "
        "attainment by rate (req/s: share) |",
        "|---|---|---:|---|---:|---|",
    ]
    for run, s in zip(runs, searches, strict=True):
        bracket = f"{_rate(s['highest_passing_rate'])} / {_rate(s['lowest_failing_rate'])}"
        lines.append(
            f"| {run.label} | {run.spec.kind} | {s['goodput_distserve_rps']:g} | {bracket} | "
            f"{s['search']['runs_used']} | {_curve_text(s)} |"
        )
    values = [(r.label, _goodput(r)) for r in runs]
    lines += ["", "Reading: " + verdict("goodput (DistServe)", "req/s", values, True) + "."]
    lines += [f"- {run.label}: {s['note']}." for run, s in zip(runs, searches, strict=True)]
    lines += ["", "![SLO attainment against the offered rate](goodput.png)", ""]
    lines += _under_load(runs, searches)
    return lines


def _under_load(runs: list[Run], searches: list[dict[str, Any]]) -> list[str]:
    """Decode steadiness at each rate the searches ran: ITL p99 and TPOT p99 per run (the
    fixed-rate row above is one light rate; prefill stalls show as the rate rises)."""
    lines = [
        "Decode under load, from the search runs: ITL p99 / TPOT p99 (ms) at each rate (req/s).",
        "",
        "| deployment | ITL p99 / TPOT p99 by rate |",
        "|---|---|",
    ]
    for run, s in zip(runs, searches, strict=True):
        cells = []
        for r in sorted(s.get("runs", []), key=lambda r: float(r["config"]["rate"])):
            itl, tpot = (r.get(k) or {} for k in ("itl_ms", "tpot_ms"))
            i, t = itl.get("p99"), tpot.get("p99")
            cells.append(
                f"{float(r['config']['rate']):g}: {'-' if i is None else _short(i)} / "
                f"{'-' if t is None else _short(t)}"
            )
        lines.append(f"| {run.label} | {', '.join(cells) or '-'} |")
    return [*lines, ""]


def plot_goodput(runs: list[Run], path: Path) -> None:
    """Each deployment's attainment curve, the threshold and each goodput, in one plot."""
    import matplotlib

    from proxy.bench.report import save_attainment_plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    searches = [r.search for r in runs if r.search is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (run, search) in enumerate(zip(runs, searches, strict=True)):
        xs = [row["rate"] for row in search["curve"]]
        ys = [100 * row["attainment"] for row in search["curve"]]
        goodput = search["goodput_distserve_rps"]
        ax.plot(xs, ys, "o-", color=f"C{i}", label=f"{run.label}: {goodput:g} req/s")
        if goodput > 0:
            ax.axvline(goodput, color=f"C{i}", linestyle=":")
    threshold = 100 * searches[0]["attainment_threshold"]
    ax.axhline(threshold, color="black", linestyle="--", label=f"threshold {threshold:.0f}%")
    slo = searches[0]["slo"]
    ax.set_title(f"TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms")
    save_attainment_plot(fig, ax, path)


def plot_comparison(runs: list[Run], path: Path) -> None:
    """p50 and p99 of TTFT, TPOT and ITL, one bar per deployment, each labelled with its value
    (deployment i in colour Ci, as in the goodput plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 + 3 * len(runs), 4.5))
    width = 0.8 / len(runs)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for i, run in enumerate(runs):
            values = [run.bench[key][p] or 0.0 for p in ("p50", "p99")]
            xs = [x + i * width for x in (0, 1)]
            bars = ax.bar(xs, values, width, label=run.label, color=f"C{i}")
            ax.bar_label(bars, labels=[_short(v) for v in values], fontsize=7)
        ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in (0, 1)], ["p50", "p99"])
        ax.set_title(f"{title} (ms)")
        ax.grid(alpha=0.3, axis="y")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run",
        type=run_spec,
        action="append",
        default=[],
        metavar="KIND:LABEL=DIR",
        help=f"one deployment's run dir (repeatable, in report order); KIND: {', '.join(KINDS)}",
    )
    p.add_argument("--colocated", type=Path, help="shorthand: --run colocated:LABEL=DIR, first")
    p.add_argument("--disagg", type=Path, help="shorthand: --run disagg:LABEL=DIR, next")
    p.add_argument("--colocated-label", default="colocated", help="LABEL of --colocated")
    p.add_argument("--disagg-label", default="1P1D", help="LABEL of --disagg")
    p.add_argument("--goal-goodput-ratio", type=float, default=Goal.goodput_ratio)
    p.add_argument("--goal-itl-ratio", type=float, default=Goal.itl_ratio)
    p.add_argument("--out", type=Path, required=True, help="the Markdown file to write")
    p.add_argument("--context", action="append", default=[], help="a setup line (repeatable)")
    p.add_argument(
        "--capacity", type=Path, default=None, help="scripts/workload_capacity.py's JSON"
    )
    p.add_argument(
        "--capacity-cores", type=int, default=2, help="cores the nodes share: %(default)s"
    )
    return p


def _specs(args: argparse.Namespace) -> list[RunSpec]:
    specs = []
    if args.colocated is not None:
        specs.append(RunSpec("colocated", args.colocated_label, args.colocated))
    if args.disagg is not None:
        specs.append(RunSpec("disagg", args.disagg_label, args.disagg))
    return specs + args.run


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        specs = _specs(args)
        if not specs:
            p.error("give at least one --run (or --colocated / --disagg)")
        runs = load_runs(specs)
        goal = Goal(args.goal_goodput_ratio, args.goal_itl_ratio)
        capacity = load_capacity(args.capacity, args.capacity_cores)
        text = render(runs, args.out, args.context, goal, capacity)
    except ValueError as e:
        print(f"compare_report: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_comparison(runs, args.out.parent / "compare.png")
    if runs[0].search is not None:
        plot_goodput(runs, args.out.parent / "goodput.png")
    args.out.write_text(text + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
