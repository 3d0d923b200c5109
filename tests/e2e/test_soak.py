"""Issue 5: `scripts/soak.py`, shortened, against 2P2D: random disconnects at random times,
then every node at baseline, every completed output equal to offline, no errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import procs
from tests.support.cluster import start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_soak_with_random_disconnects_leaves_nothing_behind(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cluster = start_cluster(tiny_model_dir, (2, 2, 0))
    try:
        assert cluster.proxy is not None
        out = tmp_path / "soak.json"
        argv = procs.python("scripts/soak.py", "--base-url", cluster.proxy.url)
        argv += ["--model", str(tiny_model_dir), "--requests", "60", "--concurrency", "12"]
        argv += ["--disconnect-prob", "0.4", "--max-drop-s", "0.8", "--max-tokens", "32"]
        argv += ["--seed", "7", "--json", str(out), "--no-progress"]
        proc = procs.run(argv, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summary = json.loads(out.read_text())
        assert summary["ok"] and all(summary["checks"].values()), summary
        assert summary["requests"] == 60
        assert summary["completed"] >= 10 and summary["disconnected"] >= 5, summary
        assert summary["completed"] + summary["disconnected"] == 60
        assert summary["proxy_outcomes"].get("cancelled", 0) >= 1
        cluster.wait_baseline()
    finally:
        cluster.close()
