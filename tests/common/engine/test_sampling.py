"""Sampling: parameters, the batched sampler, and seeded requests through the engine.

The allowed top-k / top-p sets are computed here independently (float64, from the
logits) and every sampled token must fall inside them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.sampling import sample
from common.wire.sampling_params import SamplingParams

VOCAB = 64


def random_logits(n: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def sample_one(row: torch.Tensor, params: SamplingParams, index: int = 0) -> int:
    return sample(row[None, :], [params], [index])[0]


# -- SamplingParams ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"temperature": 100.5},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_k": -2},
        {"seed": -1},
        {"seed": 2**63},
        {"max_tokens": 0},
        {"stop_token_ids": ["x"]},
        {"best_of": 2},  # unknown fields are refused, not ignored
    ],
)
def test_sampling_params_reject_out_of_range(bad):
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


def test_sampling_params_defaults_and_normalization():
    p = SamplingParams(top_k=0, temperature=0)
    assert p.top_k == -1 and p.greedy
    assert not SamplingParams().greedy
    with pytest.raises(ValidationError):
        p.temperature = 1.0  # frozen


# -- the sampler ---------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(16)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=i) for i in range(16)]
    assert sample(logits, params, [0] * 16) == logits.argmax(-1).tolist()


def test_greedy_rows_mixed_with_sampled_rows():
    logits = random_logits(8, seed=1)
    greedy = SamplingParams(temperature=0.0)
    sampled = [SamplingParams(temperature=1.3, seed=100 + i, top_k=20) for i in range(8)]
    params = [greedy if i % 2 == 0 else sampled[i] for i in range(8)]
    out = sample(logits, params, list(range(8)))
    for i in range(8):
        if i % 2 == 0:
            assert out[i] == int(logits[i].argmax())
        else:
            assert out[i] == sample_one(logits[i], sampled[i], i)
    # The same greedy rows next to unseeded sampled rows.
    unseeded = SamplingParams(temperature=2.0)
    out = sample(logits, [greedy if i % 2 == 0 else unseeded for i in range(8)], [0] * 8)
    assert out[::2] == logits[::2].argmax(-1).tolist()


other_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    top_k=st.sampled_from([-1, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    seed=st.none() | st.integers(0, 2**32),
)


@settings(max_examples=40, deadline=None)
@given(
    others=st.lists(other_params, max_size=6),
    position=st.integers(0, 6),
    index=st.integers(0, 1000),
    logits_seed=st.integers(0, 2**16),
    target=st.sampled_from(
        [
            SamplingParams(temperature=0.8, top_k=30, top_p=0.95, seed=1234),
            SamplingParams(temperature=1.0, seed=99),
        ]
    ),
)
def test_seeded_row_is_independent_of_its_batch(others, position, index, logits_seed, target):
    logits = random_logits(len(others) + 1, seed=logits_seed)
    position = min(position, len(others))
    alone = sample_one(logits[position], target, index)
    params = others[:position] + [target] + others[position:]
    indices = [(7 * i) % 13 for i in range(len(params))]
    indices[position] = index
    torch.manual_seed(logits_seed)  # the global RNG must not matter to seeded rows
    assert sample(logits, params, indices)[position] == alone


def test_seeds_differ_and_output_index_matters():
    flat = torch.zeros(1, 512)  # uniform: every draw is a fair 1-in-512
    runs = {
        seed: [sample(flat, [SamplingParams(seed=seed)], [i])[0] for i in range(16)]
        for seed in range(8)
    }
    assert len({tuple(r) for r in runs.values()}) == len(runs)
    assert all(len(set(r)) > 1 for r in runs.values())
    again = [sample(flat, [SamplingParams(seed=3)], [i])[0] for i in range(16)]
    assert again == runs[3]


def allowed_tokens(logits: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """Tokens inside the top-k set and, within it, the top-p nucleus (float64)."""
    vocab = len(logits)
    order = sorted(range(vocab), key=lambda i: -logits[i])
    k = top_k if 0 < top_k < vocab else vocab
    kth = logits[order[k - 1]]
    in_k = [i for i in range(vocab) if logits[i] >= kth]  # ties at the edge count
    top = max(logits)
    weight = {i: math.exp((logits[i] - top) / temperature) for i in in_k}
    total = sum(weight.values())
    prob = {i: w / total for i, w in weight.items()}
    # i is in the nucleus if the mass strictly more likely than i is < top_p
    # (with a little slack for float32 rounding in the sampler).
    return {i for i in in_k if sum(q for q in prob.values() if q > prob[i]) < top_p + 1e-5}


@settings(max_examples=120, deadline=None)
@given(
    halves=st.lists(st.integers(-12, 12), min_size=2, max_size=40),
    temperature=st.floats(0.1, 3.0),
    top_k=st.sampled_from([-1, 0]) | st.integers(1, 45),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**40),
)
def test_top_k_top_p_never_sample_outside_the_allowed_set(halves, temperature, top_k, top_p, seed):
    logits = [h / 2 for h in halves]  # multiples of 0.5: ties are exact ties
    n = 256
    rows = torch.tensor([logits] * n)
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + i)
        for i in range(n // 2)
    ] + [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * (n // 2)
    out = sample(rows, params, list(range(n)))
    allowed = allowed_tokens(logits, temperature, top_k, top_p)
    assert set(out) <= allowed, (sorted(set(out) - allowed), sorted(allowed))


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [
        (2, 1.0, {0, 1}),
        (3, 1.0, {0, 1, 2}),
        (-1, 0.65, {0, 1}),  # 0.4 + 0.3 reaches 0.65
        (-1, 0.75, {0, 1, 2}),
        (3, 0.75, {0, 1}),  # within the top 3: (0.4 + 0.3) / 0.9 >= 0.75
        (3, 0.8, {0, 1, 2}),
        (-1, 1.0, {0, 1, 2, 3}),
    ],
)
def test_top_k_top_p_sets_are_exact(top_k, top_p, expected):
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    n = 400
    params = [SamplingParams(top_k=top_k, top_p=top_p, seed=i) for i in range(n)]
    assert set(sample(logits.repeat(n, 1), params, [0] * n)) == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.4, 0.3, 0.2, 0.1]),
        (SamplingParams(temperature=0.5), [16 / 30, 9 / 30, 4 / 30, 1 / 30]),  # p^(1/T)
        (SamplingParams(temperature=1.0, top_k=2), [4 / 7, 3 / 7, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0.0]),
    ],
)
def test_sampled_frequencies_match_the_distribution(params, expected):
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    n = 20_000
    torch.manual_seed(0)  # a fixed draw: the test cannot flake
    unseeded = sample(logits.repeat(n, 1), [params] * n, [0] * n)
    seeded_params = [params.model_copy(update={"seed": i}) for i in range(n)]
    seeded = sample(logits.repeat(n, 1), seeded_params, [0] * n)
    for out in (unseeded, seeded):
        counts = torch.bincount(torch.tensor(out), minlength=4).double() / n
        for got, want in zip(counts.tolist(), expected, strict=True):
            sigma = math.sqrt(want * (1 - want) / n)
            assert abs(got - want) <= 5 * sigma + 1e-9, (counts.tolist(), expected)


@pytest.mark.parametrize("top_k", [-1, 300])
def test_top_p_over_a_wide_nucleus_is_exact(top_k):
    # A flat distribution over 5000 tokens: the nucleus holds thousands of them, so the
    # sampler must widen its candidate set well past the first guess.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5000, generator=g) * 0.1
    top_p = 0.5
    allowed = allowed_tokens(logits.tolist(), 1.0, top_k, top_p)
    n = 2000
    params = [SamplingParams(top_p=top_p, top_k=top_k, seed=i) for i in range(n)]
    out = sample(logits.repeat(n, 1), params, [0] * n)
    assert set(out) <= allowed
    assert len(set(out)) > 100  # draws spread over the nucleus, not stuck in the guess


def test_tiny_top_p_or_top_k_1_is_argmax():
    logits = random_logits(32, seed=5)
    for p in (SamplingParams(top_p=1e-6, seed=1), SamplingParams(top_k=1, temperature=5.0)):
        assert sample(logits, [p] * 32, list(range(32))) == logits.argmax(-1).tolist()


# -- seeded requests through the engine ----------------------------------------


def prompts(*lens: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def run(engine, driver_cls, requests: dict[str, tuple[list[int], SamplingParams]]):
    driver = driver_cls(engine)
    for rid, (prompt, params) in requests.items():
        driver.add(rid, prompt, params)
    return driver.finish()


def test_seeded_request_same_alone_in_batch_and_after_preemption(hf_checkpoint, engine_driver):
    path = str(hf_checkpoint("llama").path)
    target, p1, p2, p3 = prompts(11, 40, 5, 70)
    seeded = SamplingParams(temperature=2.0, top_k=100, seed=42, max_tokens=16, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=path, num_blocks=64))
    alone = run(engine, engine_driver, {"t": (target, seeded)})["t"]
    crowd = {
        "a": (p1, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)),
        "t": (target, seeded),
        "b": (p2, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
        "c": (p3, seeded.model_copy(update={"seed": 43})),
    }
    together = run(engine, engine_driver, crowd)
    assert together["t"] == alone
    assert together["c"] != alone  # another seed (and prompt) samples differently

    # A pool this small preempts the newest request, "t", mid-decode (its KV is
    # recomputed); the seed still holds.
    small = LLMEngine(EngineConfig(model=path, num_blocks=7, block_size=8))
    driver = engine_driver(small)
    driver.add("a", p1, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
    driver.add("c", p1[:30], seeded.model_copy(update={"seed": 43}))
    driver.add("t", target, seeded)
    preempted_mid_decode = False
    while small.has_work():
        driver.step()
        preempted_mid_decode |= any(
            s.request_id == "t" and s.num_output_tokens > 0 for s in small.scheduler.waiting
        )
    assert preempted_mid_decode
    assert driver.finish()["t"] == alone


def test_different_seeds_give_different_outputs(hf_checkpoint, engine_driver):
    engine = LLMEngine(EngineConfig(model=str(hf_checkpoint("llama").path), num_blocks=64))
    (prompt,) = prompts(6)
    requests = {
        str(s): (prompt, SamplingParams(temperature=2.0, seed=s, max_tokens=12, ignore_eos=True))
        for s in range(4)
    }
    outs = run(engine, engine_driver, requests)
    assert len({tuple(t) for t in outs.values()}) == 4
