"""`--cuda-graphs`: the captured sizes, the refusal off CUDA, and (where a GPU is present,
as in scripts/gpu_check.sh) graphed decode steps equal to eager ones at live batch sizes
between the captured ones."""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.cuda_graphs import capture_sizes
from common.engine.engine import LLMEngine
from common.wire.sampling_params import SamplingParams


def test_capture_sizes_cover_every_batch_up_to_the_maximum() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_graphs_off_cuda_is_a_clear_error(hf_checkpoint) -> None:
    config = EngineConfig(model=str(hf_checkpoint("llama").path), num_blocks=16, device="cpu")
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        LLMEngine(EngineConfig(**{**config.__dict__, "cuda_graphs": True}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 3, 9, 17])
def test_graphed_decode_equals_eager(hf_checkpoint, batch: int) -> None:
    path = str(hf_checkpoint("llama").path)
    common = dict(model=path, num_blocks=256, device="cuda", kernel_backend="triton",
                  max_num_seqs=24)  # fmt: skip
    eager = LLMEngine(EngineConfig(**common))
    graphed = LLMEngine(EngineConfig(**common, cuda_graphs=True))
    g = torch.Generator(device="cpu").manual_seed(batch)
    prompts = [torch.randint(0, 512, (5 + 3 * i,), generator=g).tolist() for i in range(batch)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=12, ignore_eos=True)
    for params in (greedy, seeded):
        want = [c.token_ids for c in eager.generate(prompts, params)]
        got = [c.token_ids for c in graphed.generate(prompts, params)]
        assert got == want
    assert graphed.runner.graphs is not None and graphed.runner.graphs.replays > 0
