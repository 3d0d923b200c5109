"""The real model's 4-bit weights (SmolLM2's Q4_1 GGUF) kept in int4 for decode steps:
recovered for every decoder linear layer, computing what the dense bfloat16 ones do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.model.decoder import PackedLinear
from common.model.weights import load_model
from common.wire.sampling_params import SamplingParams
from kernels import cpu_linear
from tests.support.schedule import TORCH_THREADS

PROMPTS = ["Write a list of five fruits.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def bf16_model(smollm2_dir: Path) -> torch.nn.Module:
    model, _ = load_model(smollm2_dir, "bfloat16")
    if not any(getattr(m, "int4", None) is not None for m in model.modules()):
        pytest.skip("no bfloat16 int4 kernel on this CPU")
    return model


def test_every_decoder_linear_layer_is_recovered_as_4_bit(bf16_model: torch.nn.Module) -> None:
    n_layers = bf16_model.config.num_layers
    packed = [m for m in bf16_model.modules() if isinstance(m, PackedLinear)]
    assert sum(m.int4 is not None for m in packed) == 4 * n_layers  # qkv, o, gate_up, down
    assert bf16_model.lm_head.int4 is None  # the tied embedding is not 4-bit in this file
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in packed[:: len(packed) // 9]:
            if m.int4 is None:
                continue
            x = torch.randn(8, m.int4.scales_zeros.shape[0] * m.int4.group, generator=g)
            x = x.bfloat16()
            got = cpu_linear.linear_int4(x, m.int4, m.bias).float()
            want = cpu_linear.linear(x, m.packed, m.bias).float()
            # both are the same values rounded to bfloat16 along different paths
            assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_greedy_text_matches_the_dense_weights(
    smollm2_dir: Path, bf16_model: object, our_hf_tokenizer: Any
) -> None:
    sp = SamplingParams(max_tokens=12, temperature=0.0)

    def run(int4: bool) -> list[list[int]]:
        engine = LLMEngine(
            EngineConfig(
                model=str(smollm2_dir), dtype="bfloat16", num_blocks=64,
                threads=TORCH_THREADS, int4_weights=int4,
            )
        )  # fmt: skip
        prompts = [our_hf_tokenizer(p).input_ids for p in PROMPTS]
        return [o.token_ids for o in engine.generate(prompts, sp)]

    assert run(True) == run(False)
