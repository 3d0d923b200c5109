"""`pdserve generate` on the built-in model, run as a user runs it (a child process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams
from tests.support import procs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "Héllo wörld, 你好 🌿"


def test_generate_cli_json_matches_engine(tiny_model_dir: Path) -> None:
    cmd = procs.module("common.cli", "generate", "--model", str(tiny_model_dir))
    cmd += ["--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos", "--json"]
    res = procs.run(cmd, timeout=120, check=True)
    out = json.loads(res.stdout)
    tok = Tokenizer.from_dir(tiny_model_dir)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=32))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (done,) = engine.generate([tok.encode(PROMPT)], sp)
    ids = done.token_ids
    assert out == {"token_ids": ids, "text": tok.decode(ids)}


def test_generate_cli_streams_text(tiny_model_dir: Path) -> None:
    cmd = procs.module("common.cli", "generate", "--model", str(tiny_model_dir))
    cmd += ["--prompt", "Hello", "--max-tokens", "8", "--chat", "--seed", "3"]
    cmd += ["--temperature", "0.8"]
    res = procs.run(cmd, timeout=120, check=True)
    assert res.stdout.strip()


def test_generate_cli_bad_model_dir_is_a_message(tmp_path: Path) -> None:
    cmd = procs.module("common.cli", "generate", "--model", str(tmp_path), "--prompt", "x")
    res = procs.run(cmd, timeout=120, env=procs.child_env(PYTHONWARNINGS=""))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "tokenizer.json" in res.stderr or "config.json" in res.stderr
