"""The logit processors on the real model: pdserve's engine with penalties, logit_bias and
min_tokens generates, greedy, token for token what transformers' `generate` does on the
.gguf with its own processors (RepetitionPenalty, MinNewTokensLength, SequenceBias, and
OpenAI's frequency/presence formula as a processor of the test's own) in our order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.wire.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Write a list of five fruits.",
    "Say hello hello hello hello.",
    "What is the capital of France?",
]
MAX_TOKENS = 24


class OpenAIPenalties(transformers.LogitsProcessor):  # type: ignore[misc]
    """logit -= frequency * count + presence * (count > 0), over the tokens after the prompt."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.prompt_len :].tolist()
        for tok in set(out):
            scores[0, tok] -= self.frequency * out.count(tok) + self.presence
        return scores


def _processors(sp: SamplingParams, prompt_len: int, eos: list[int]) -> Any:
    procs = []
    if sp.min_tokens:
        procs.append(transformers.MinNewTokensLengthLogitsProcessor(prompt_len, sp.min_tokens, eos))
    if sp.logit_bias:
        procs.append(transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in sp.logit_bias]))
    if sp.repetition_penalty != 1.0:
        procs.append(transformers.RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.frequency_penalty or sp.presence_penalty:
        procs.append(OpenAIPenalties(prompt_len, sp.frequency_penalty, sp.presence_penalty))
    return transformers.LogitsProcessorList(procs)


def _reference(model: Any, ids: list[int], sp: SamplingParams, eos: list[int]) -> list[int]:
    x = torch.tensor([ids])
    return model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=sp.max_tokens,
        do_sample=False,
        logits_processor=_processors(sp, len(ids), eos),
        eos_token_id=eos,
    )[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(smollm2_dir), num_blocks=256, threads=2))


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.3),
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, frequency_penalty=0.6, presence_penalty=0.4
        ),
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            min_tokens=MAX_TOKENS,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            logit_bias=((28, 3.0), (30, -100.0)),
        ),
    ],
    ids=["repetition", "frequency-presence", "min_tokens-bias-mixed"],
)
def test_engine_with_processors_matches_transformers(
    sp: SamplingParams, engine: LLMEngine, ref_model: Any, ref_tokenizer: Any
) -> None:
    prompts = [
        ref_tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    ids = [ref_tokenizer(p).input_ids for p in prompts]
    eos = list(engine.model_config.eos_token_ids)
    assert ref_tokenizer.eos_token_id in eos
    plain = engine.generate(ids, sp.model_copy(update={
        "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "min_tokens": 0, "logit_bias": (),
    }))  # fmt: skip
    got = engine.generate(ids, sp)
    engine.check_integrity()
    with torch.inference_mode():
        want = [_reference(ref_model, x, sp, eos) for x in ids]
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        assert g.token_ids == w, prompt
    assert any(g.token_ids != p.token_ids for g, p in zip(got, plain, strict=True))
    if sp.min_tokens:
        assert all(len(g.token_ids) == MAX_TOKENS for g in got)
