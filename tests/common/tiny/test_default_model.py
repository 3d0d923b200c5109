"""The built-in default model: pdserve's greedy outputs equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Héllo wörld, 你好 🌿", "def f(x):\n    return"]


def _hf_greedy(model_dir: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_tiny_model_greedy_matches_transformers(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [tok.encode(p) for p in PROMPTS]
    done = engine.generate(prompts, sp)  # all three in one batch
    engine.check_integrity()
    assert engine.allocator.counts()["free"] == 64
    for text, ids, got in zip(PROMPTS, prompts, done, strict=True):
        assert got.token_ids == _hf_greedy(tiny_model_dir, ids, 16), text
