"""The batched sampler.

Sampling draws with the exponential race (argmax of p / E, E ~ Exp(1)), which
picks token i with probability p_i. A seeded request draws its noise from a
generator seeded by (seed, output index), so its output is reproducible whatever
batch it runs in, after preemption, and on whichever node samples the token.
"""

from __future__ import annotations

import torch

from common.wire.sampling_params import SamplingParams


def _noise_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index) % (2**63 - 1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
) -> list[int]:
    """Pick one token per row.

    logits: [N, vocab] float32; params[i] and output_index[i] (how many tokens row i's
    request has generated so far) describe row i.
    """
    greedy = [p.greedy for p in params]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
    n, vocab = logits.shape
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        probs = _top_k_top_p(probs, params)
    noise = torch.empty_like(probs)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab).exponential_()
    for i, p in enumerate(params):
        if p.seed is not None:
            g = torch.Generator().manual_seed(
                _noise_seed(p.seed, p.output_index_base + output_index[i])
            )
            noise[i] = torch.empty(vocab).exponential_(generator=g)
    sampled = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
    if any(greedy):
        sampled = torch.where(torch.tensor(greedy), logits.argmax(dim=-1), sampled)
    return sampled.tolist()


def _top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero every probability outside each row's top-k / top-p (nucleus) set."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    ps = torch.tensor([p.top_p for p in params])
    rank = torch.arange(vocab)[None, :]
    drop = rank >= ks[:, None]
    kept = sorted_p.masked_fill(drop, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    # Nucleus over the top-k set: keep the smallest prefix whose mass reaches top_p
    # (the most likely token always stays).
    before = kept.cumsum(dim=-1) - kept
    drop |= before >= ps[:, None]
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
