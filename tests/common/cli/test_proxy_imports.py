"""The proxy process never loads torch (nor the engine, the model or the KV-transfer layer):
the `pdserve proxy` command line, its handler and the proxy resolve everything without them,
which keeps the proxy's start fast and its memory small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import procs

CHECK = """
import sys
from common.cli.main import main
from common.cli.proxy_args import proxy_parser
import common.cli.proxy, proxy.main
args = proxy_parser().parse_args(["--model", sys.argv[1], "--prefill", "http://127.0.0.1:1"])
common.cli.proxy.settings_from_args(args)
heavy = ("torch", "common.engine.engine", "kv_transfer", "nixl")
print(",".join(m for m in heavy if m in sys.modules) or "none")
"""


@pytest.mark.e2e  # a fresh interpreter, to see what importing loads
def test_the_proxy_command_line_and_its_runtime_load_no_torch(tiny_model_dir: Path) -> None:
    # (a model directory that exists: making the tiny model, a node's job, needs torch)
    argv = [sys.executable, "-c", CHECK, str(tiny_model_dir)]
    env = procs.child_env()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "none"
