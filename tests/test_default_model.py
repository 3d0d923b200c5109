"""The built-in default model end to end: pdserve vs transformers, the CLI, the engine thread."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loop import AsyncEngine
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Héllo wörld, 你好 🌿", "def f(x):\n    return"]


def _hf_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_tiny_model_greedy_matches_transformers(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = {str(i): tok.encode(p) for i, p in enumerate(PROMPTS)}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, sp)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    engine.check_integrity()
    assert engine.allocator.counts()["free"] == 64
    for rid, ids in prompts.items():
        assert got[rid] == _hf_greedy(tiny_model_dir, ids, 16), rid


def test_generate_cli_json_matches_engine(tiny_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "common.cli", "generate", "--model", str(tiny_model_dir)]
    cmd += ["--prompt", PROMPTS[1], "--max-tokens", "12", "--ignore-eos", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(res.stdout)
    tok = Tokenizer.from_dir(tiny_model_dir)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=32))
    engine.add_request(
        "r", tok.encode(PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    ids: list[int] = []
    while engine.has_work():
        for o in engine.step():
            ids += o.new_token_ids
    assert out == {"token_ids": ids, "text": tok.decode(ids)}


def test_generate_cli_streams_text(tiny_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "common.cli", "generate", "--model", str(tiny_model_dir)]
    cmd += ["--prompt", "Hello", "--max-tokens", "8", "--chat", "--seed", "3"]
    cmd += ["--temperature", "0.8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert res.stdout.strip()


def test_generate_cli_bad_model_dir_is_a_message(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "common.cli", "generate", "--model", str(tmp_path)]
    cmd += ["--prompt", "x"]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": ""}
    )
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "tokenizer.json" in res.stderr or "config.json" in res.stderr


def test_async_engine_streams_and_aborts(tiny_model_dir: Path) -> None:
    async def run() -> None:
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
        front = AsyncEngine(engine, asyncio.get_running_loop())
        await front.start()
        try:
            sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

            async def collect(rid: str) -> list[int]:
                ids: list[int] = []
                async for out in front.generate(rid, [5, 6, 7, 8], sp):
                    ids += out.new_token_ids
                return ids

            a, b = await asyncio.gather(collect("a"), collect("b"))
            assert a == b and len(a) == 10

            # A consumer that stops early aborts its request; blocks come back.
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            gen = front.generate("c", [5, 6, 7], long)
            await gen.__anext__()
            await gen.aclose()
            for _ in range(200):
                if engine.state()["blocks"]["free"] == 64 and not engine.has_work():
                    break
                await asyncio.sleep(0.01)
            assert engine.state()["blocks"]["free"] == 64
        finally:
            await front.stop()
        engine.check_integrity()

    asyncio.run(run())
