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
from tests.support.schedule import TORCH_THREADS

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
    return LLMEngine(EngineConfig(model=str(smollm2_dir), num_blocks=256, threads=TORCH_THREADS))


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


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0, max_tokens=12, logprobs=5),
        SamplingParams(temperature=0.7, seed=3, max_tokens=12, logprobs=3, repetition_penalty=1.2),
    ],
    ids=["greedy", "sampled-penalized"],
)
def test_logprobs_equal_transformers_log_softmax(
    sp: SamplingParams, engine: LLMEngine, ref_model: Any, ref_tokenizer: Any
) -> None:
    """Each reported logprob (the sampled token's and the top ones) is transformers'
    log-softmax at that position, after the processors and the temperature."""
    text = ref_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    ids = ref_tokenizer(text).input_ids
    (done,) = engine.generate([ids], sp)
    assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
    procs = _processors(sp, len(ids), list(engine.model_config.eos_token_ids))
    if sp.temperature:
        procs.append(transformers.TemperatureLogitsWarper(sp.temperature))
    full = torch.tensor([ids + done.token_ids])
    with torch.inference_mode():
        logits = ref_model(full).logits[0].float()
    for i, (token, lp) in enumerate(zip(done.token_ids, done.logprobs, strict=True)):
        pos = len(ids) + i - 1
        scores = procs(full[:, : pos + 1], logits[pos : pos + 1].clone())
        want = torch.log_softmax(scores[0], dim=-1)
        assert lp.logprob == pytest.approx(float(want[token]), abs=2e-3), i
        top_v, top_i = want.topk(sp.logprobs or 0)
        got_ids = [t for t, _ in lp.top]
        assert len(got_ids) == sp.logprobs
        for (t, v), wv in zip(lp.top, top_v.tolist(), strict=True):
            assert v == pytest.approx(wv, abs=2e-3) and v == pytest.approx(float(want[t]), abs=2e-3)
        if sp.greedy:
            assert got_ids[0] == token == int(top_i[0])


def test_prompt_logprobs_equal_transformers_log_softmax(
    engine: LLMEngine, ref_model: Any, ref_tokenizer: Any
) -> None:
    """echo's prompt logprobs: the model's own log-softmax at every prompt position."""
    ids = ref_tokenizer("The capital of France is Paris, and the capital of Italy is").input_ids
    (done,) = engine.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert done.prompt_logprobs is not None and len(done.prompt_logprobs) == len(ids) - 1
    with torch.inference_mode():
        want = torch.log_softmax(ref_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos, lp in enumerate(done.prompt_logprobs):
        assert lp.logprob == pytest.approx(float(want[pos, ids[pos + 1]]), abs=2e-3), pos
        top_v, top_i = want[pos].topk(2)
        assert [t for t, _ in lp.top] == top_i.tolist() or top_v[0] - top_v[1] < 1e-3
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=2e-3)
