"""scripts/chaos.py, shortened: kills, relaunches and link flaps of 2P2D nodes in network
namespaces under streaming load; every request exact or a clear error, nothing leaked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import procs
from tests.support.netns import NetLab

WHY_NOT = NetLab.unavailable()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces unavailable: {WHY_NOT}"),
]


def test_a_short_chaos_run_holds_every_invariant(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    argv = [sys.executable, "scripts/chaos.py", "--duration-s", "7", "--fault-every-s", "2"]
    argv += ["--concurrency", "4", "--seed", "1", "--json", str(report)]
    out = procs.run(argv, timeout=600)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    figures = json.loads(report.read_text())
    assert sum(figures["faults"].values()) >= 1 and figures["completed"] > 0, figures
