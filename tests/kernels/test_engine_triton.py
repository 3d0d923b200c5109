"""The engine on the Triton kernels reproduces its greedy outputs on the torch kernels.

On CPU the Triton kernels run under the interpreter (see conftest.py), so the
generation is short; prompts are chunked (a tiny token budget) so that steps mix
decode tokens with prefill chunks over a cached prefix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.wire.sampling_params import SamplingParams

PROMPTS = {"short": [5, 6, 7], "long": list(range(40, 77))}  # 3 and 37 tokens


def _greedy(model_dir: Path, device: torch.device, backend: str) -> list[list[int]]:
    config = EngineConfig(
        model=str(model_dir),
        device=device.type,
        num_blocks=16,
        block_size=16,
        max_num_batched_tokens=20,
        kernel_backend=backend,
    )
    engine = LLMEngine(config)
    assert engine.kernels.name == backend
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    done = engine.generate(list(PROMPTS.values()), sp)  # both in flight at once
    engine.check_integrity()
    assert engine.allocator.counts()["free"] == 16
    return [c.token_ids for c in done]


@pytest.mark.slow
def test_triton_engine_matches_torch_engine(tiny_model_dir, triton_ops, device):
    want = _greedy(tiny_model_dir, device, "torch")
    assert all(len(t) == 8 for t in want)
    assert _greedy(tiny_model_dir, device, "triton") == want
