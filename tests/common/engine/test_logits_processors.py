"""Logit processors against transformers' own (repetition penalty, min new tokens, sequence
bias) and against OpenAI's frequency/presence formula written out per token; the order is
vLLM's (min_tokens, logit_bias, repetition, frequency/presence)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.logits_processors import apply_processors
from common.wire.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 40
EOS = (3,)


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def _openai_penalties(row: torch.Tensor, output: list[int], freq: float, pres: float) -> None:
    for tok in set(output):
        row[tok] -= freq * output.count(tok) + pres


def _reference(
    row: torch.Tensor, sp: SamplingParams, history: list[int], num_prompt: int
) -> torch.Tensor:
    """transformers' processors (and OpenAI's formula) for one row, in our order."""
    ids = torch.tensor([history])
    start = max(0, num_prompt - sp.output_index_base)
    scores = row.clone()[None, :]
    banned = [*sp.stop_token_ids, *(() if sp.ignore_eos else EOS)]
    if sp.min_tokens and banned:
        proc = transformers.MinNewTokensLengthLogitsProcessor(start, sp.min_tokens, banned)
        scores = proc(ids, scores)
    if sp.logit_bias:
        bias = [[[t], b] for t, b in sp.logit_bias]
        scores = transformers.SequenceBiasLogitsProcessor(bias)(ids, scores)
    if sp.repetition_penalty != 1.0:
        scores = transformers.RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, scores)
    out = scores[0].clone()
    _openai_penalties(out, history[start:], sp.frequency_penalty, sp.presence_penalty)
    return out


CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(min_tokens=5, max_tokens=16),
    SamplingParams(min_tokens=5, max_tokens=16, stop_token_ids=(7, 9)),
    SamplingParams(min_tokens=5, max_tokens=16, ignore_eos=True, stop_token_ids=(7,)),
    SamplingParams(logit_bias=((1, 5.0), (2, -100.0), (39, 0.25))),
    SamplingParams(
        logit_bias=((4, 2.0),),
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        min_tokens=3,
        max_tokens=8,
    ),
]


@pytest.mark.parametrize("sp", CASES, ids=lambda sp: repr(sp)[:60])
@pytest.mark.parametrize("num_outputs", [0, 2, 7])
def test_each_processor_equals_transformers(sp: SamplingParams, num_outputs: int) -> None:
    g = torch.Generator().manual_seed(num_outputs)
    history = torch.randint(0, VOCAB, (12 + num_outputs,), generator=g).tolist()
    history[3] = history[14 if num_outputs > 2 else 4] = 4  # a repeated token
    row = _logits(1, seed=num_outputs)[0]
    want = _reference(row, sp, history, 12)
    got = apply_processors(row.clone()[None, :], [sp], [history], [12], EOS)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    picks=st.lists(st.integers(0, len(CASES)), min_size=1, max_size=6),
    lengths=st.lists(st.integers(0, 9), min_size=6, max_size=6),
)
def test_a_batch_processes_each_row_as_alone(picks: list[int], lengths: list[int]) -> None:
    """Rows with and without processors, in any mix: each row as it would be alone, and
    rows that ask for nothing are left bit for bit as they were."""
    params = [CASES[i] if i < len(CASES) else SamplingParams() for i in picks]
    g = torch.Generator().manual_seed(len(picks))
    histories = [torch.randint(0, VOCAB, (5 + n,), generator=g).tolist() for n in lengths]
    histories = histories[: len(params)]
    logits = _logits(len(params), seed=sum(picks))
    got = apply_processors(logits.clone(), params, histories, [5] * len(params), EOS)
    for i, sp in enumerate(params):
        alone = apply_processors(logits[i : i + 1].clone(), [sp], [histories[i]], [5], EOS)
        assert torch.equal(got[i], alone[0]), sp
        if not sp.processed:
            assert torch.equal(got[i], logits[i])


def test_min_tokens_masks_until_reached() -> None:
    sp = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=(9,))
    prompt = [5, 6, 7]
    for outputs, masked in (([], True), ([1], True), ([1, 2], False)):
        row = apply_processors(_logits(1), [sp], [prompt + outputs], [3], EOS)[0]
        assert bool(row[3] == float("-inf")) is masked and bool(row[9] == float("-inf")) is masked
        assert torch.isfinite(row[[0, 1, 2, 4]]).all()


def test_a_continued_request_counts_its_earlier_outputs() -> None:
    """After a node failure the proxy re-prefills prompt + outputs so far, with
    output_index_base = how many: they are output for the penalties and min_tokens."""
    history = [10, 11, 12, 20, 20, 21]  # prompt 10..12, then three outputs
    fresh = SamplingParams(frequency_penalty=1.0, min_tokens=4, max_tokens=8)
    continued = fresh.model_copy(update={"output_index_base": 3, "max_tokens": 5})
    logits = _logits(1)
    a = apply_processors(logits.clone(), [fresh], [history], [3], EOS)
    b = apply_processors(logits.clone(), [continued], [history], [6], EOS)
    assert torch.equal(a, b)
    assert a[0, 20] == logits[0, 20] - 2.0 and a[0, 3] == float("-inf")


def test_sampling_params_bounds() -> None:
    from pydantic import ValidationError

    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"repetition_penalty": 0.0},
        {"min_tokens": 5, "max_tokens": 4},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
    ):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
    assert not SamplingParams().processed
    assert SamplingParams(logit_bias=((1, 0.5),)).processed


def test_prompt_logprobs_survive_chunking_and_skip_the_prefix_cache(tiny_model_dir) -> None:
    """Prompt logprobs computed in 16-token chunks equal those of one whole-prompt step,
    and a prompt found in the prefix cache is computed again for them."""
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine

    prompt = list(range(5, 90))
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    whole = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    chunked = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_num_batched_tokens=16)
    )
    (a,) = whole.generate([prompt], sp)
    (b,) = chunked.generate([prompt], sp)
    (again,) = chunked.generate([prompt], sp)  # the prompt's blocks are cached now
    assert a.prompt_logprobs is not None and len(a.prompt_logprobs) == len(prompt) - 1
    assert b.prompt_logprobs is not None and again.prompt_logprobs is not None
    for x, y, z in zip(a.prompt_logprobs, b.prompt_logprobs, again.prompt_logprobs, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4) == z.logprob
        assert [t for t, _ in x.top] == [t for t, _ in y.top] == [t for t, _ in z.top]
    chunked.check_integrity()
