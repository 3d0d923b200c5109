"""A request continued elsewhere (re-prefilled with the tokens so far, as the proxy does when a
decode node dies) produces the tokens the uninterrupted request would have: greedy, and
seeded sampling whose noise is keyed by output index (`output_index_base`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.wire.sampling_params import SamplingParams
from proxy.http.backend import GenerationRequest
from proxy.pool.disagg import continuation


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=128))


def _run(engine: LLMEngine, prompt: list[int], sp: SamplingParams) -> list[int]:
    (done,) = engine.generate([prompt], sp)
    return done.token_ids


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("cut", [1, 9])
def test_continuation_after_k_tokens_equals_the_uninterrupted_tail(
    engine: LLMEngine, sampling: SamplingParams, cut: int
) -> None:
    prompt = [5, 17, 300, 42, 7, 99, 1000, 3]
    whole = _run(engine, prompt, sampling)
    assert len(whole) == sampling.max_tokens
    req = GenerationRequest(f"r-{sampling.seed}-{cut}", prompt, sampling)
    cont = continuation(req, whole[:cut], 1)
    assert cont.request_id.startswith(req.request_id) and cont.request_id != req.request_id
    assert cont.prompt_token_ids == prompt + whole[:cut]
    assert cont.sampling.max_tokens == sampling.max_tokens - cut
    tail = _run(engine, cont.prompt_token_ids, cont.sampling)
    assert tail == whole[cut:]
