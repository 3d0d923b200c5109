"""The kernel scripts run: the benchmark's CPU smoke grid, and the CUDA compile check."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import procs

pytestmark = pytest.mark.e2e


def _run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return procs.run(procs.python(*args), env=procs.child_env(env), timeout=timeout)


def test_bench_kernels_prints_a_table() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["scripts/bench_kernels.py", "--device", "cpu", "--batches", "1,3"]
    res = _run([*args, "--contexts", "20,70", "--iters", "2", "--triton", "off"], env, 120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[1].split()[:5] == ["batch", "context", "triton", "torch_ref", "sdpa"]
    rows = [line.split() for line in lines[2:]]
    assert [r[:2] for r in rows] == [["1", "20"], ["1", "70"], ["3", "20"], ["3", "70"]]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)


@pytest.mark.slow
def test_kernels_compile_for_cuda(tmp_path: Path) -> None:
    """Every kernel builds to a cubin for sm_90 (no GPU needed: compile only)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    res = _run(["scripts/compile_kernels.py", "--quick", "--arch", "90"], env, 300)
    if res.returncode == 3:
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("ok   sm_90") == 2, res.stdout


def test_gpu_stress_runs_its_smoke_grid_under_the_interpreter(tmp_path: Path) -> None:
    """The GPU check's stress script, on its CPU smoke grid (a script that cannot run here
    would first fail on a lent GPU): NaN-filled unused slots, every case within tolerance."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = tmp_path / "stress.json"
    res = _run(["scripts/gpu_stress.py", "--smoke", "--json", str(out)], env, 300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gpu_stress: 5/5 cases pass" in res.stdout
    cases = json.loads(out.read_text())["cases"]
    assert {c["kind"] for c in cases} == {"decode", "prefill@100"}
    assert all(c["ok"] and not c["nan"] for c in cases)
