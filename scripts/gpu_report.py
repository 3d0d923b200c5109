#!/usr/bin/env python3
"""The GPU check's report: scripts/gpu_check.sh's step results (OUT/steps.tsv), the stress
grid (OUT/stress.json) and the benchmark logs, as OUT/report.json and OUT/report.md.

    python scripts/gpu_report.py OUT
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch


def main(out: Path) -> None:
    rows = (out / "steps.tsv").read_text().splitlines()
    steps = [dict(zip(("step", "rc", "seconds"), r.split("\t"), strict=True)) for r in rows]
    cuda = torch.cuda.is_available()
    report = {
        "device": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "steps": steps,
    }
    stress = out / "stress.json"
    if stress.exists():
        cases = json.loads(stress.read_text())["cases"]
        report["stress"] = {"cases": len(cases), "failed": [c for c in cases if not c["ok"]]}
    md = [
        f"# GPU check on {report['device']} (torch {report['torch']}, CUDA {report['cuda']})",
        "",
        "| step | exit | seconds |",
        "|---|---:|---:|",
    ]
    md += [f"| {s['step']} | {s['rc']} | {s['seconds']} |" for s in steps]
    if "stress" in report:
        s = report["stress"]
        md += ["", f"stress grid: {s['cases'] - len(s['failed'])}/{s['cases']} cases pass"]
        md += [f"- FAIL {c}" for c in s["failed"][:20]]
    for name in ("decode", "transfer", "steps", "graphs", "prefill"):
        log = out / f"{name}.log"
        if log.exists():
            md += ["", f"## {name}", "", "```", *log.read_text().splitlines()[-40:], "```"]
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text("\n".join(md) + "\n")
    print(f"report: {out}/report.md, {out}/report.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
