"""The batched sampler.

A sampled row draws one uniform number u and takes the token where u lands in the
cumulative distribution of its (temperature-scaled, top-k/top-p filtered)
probabilities, laid out in token-id order: inverse-CDF sampling, exact, and one
random number a row instead of one per vocabulary entry. A seeded request draws
its u from a generator seeded by (seed, output index), so its output is
reproducible whatever batch it runs in, after preemption, and on whichever node
samples the token (the token-id order makes it independent of how ties sort).

top-k / top-p work on the row's k most likely tokens (`torch.topk`), not a sort
of the whole vocabulary: for top-p alone, k starts small and grows until the
candidates hold top_p of the mass, which is exact (no token outside them can be
in the nucleus) and, for peaked distributions, a few dozen tokens.
"""

from __future__ import annotations

import torch

from common.wire.logprobs import LOGPROB_FLOOR, TokenLogprobs
from common.wire.sampling_params import SamplingParams

_FIRST_K = 64  # candidates tried first for a top-p-only row; grown 8x while short


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
    out = [0] * len(params)
    if any(greedy):
        rows = [i for i, g in enumerate(greedy) if g]
        for i, t in zip(rows, logits[rows].argmax(dim=-1).tolist(), strict=True):
            out[i] = t
    rows = [i for i, g in enumerate(greedy) if not g]
    sp = [params[i] for i in rows]
    temps = torch.tensor([p.temperature for p in sp], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(_take(logits, rows) / temps[:, None], dim=-1)
    u = _uniforms(sp, [output_index[i] for i in rows]).to(logits.device)
    filtered = [j for j, p in enumerate(sp) if p.top_k > 0 or p.top_p < 1.0]
    plain = [j for j, p in enumerate(sp) if not (p.top_k > 0 or p.top_p < 1.0)]
    if plain:
        picked = _inverse_cdf(_take(probs, plain), u[plain])
        for j, t in zip(plain, picked.tolist(), strict=True):
            out[rows[j]] = t
    if filtered:
        ids, weights = _top_k_top_p(probs[filtered], [sp[j] for j in filtered])
        pos = _inverse_cdf(weights, u[filtered])
        picked = ids.gather(-1, pos[:, None])[:, 0]
        for j, t in zip(filtered, picked.tolist(), strict=True):
            out[rows[j]] = t
    return out


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without the copy when rows are all of x's rows in order."""
    return x if len(rows) == x.shape[0] and rows[-1] == len(rows) - 1 else x[rows]


def _uniforms(params: list[SamplingParams], output_index: list[int]) -> torch.Tensor:
    """One U[0, 1) draw per row, on the host: seeded rows from their own CPU generator (the
    same draw on every device, so a seed gives the same token whichever node, CPU or GPU,
    samples it), others from torch's. One small copy to the logits' device follows."""
    u = torch.rand(len(params), device="cpu")
    for i, p in enumerate(params):
        if p.seed is not None:
            g = torch.Generator(device="cpu").manual_seed(
                _noise_seed(p.seed, p.output_index_base + output_index[i])
            )
            u[i] = torch.rand(1, generator=g, device="cpu")[0]
    return u


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index where u lands in the cumulative sum of `weights` ([N, n] float32,
    non-negative, not necessarily normalised). A zero-weight index is never picked: the
    first index whose running sum exceeds the target is taken, and the target is kept
    below the row's total even where u * total rounds up to it."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def _top_k_top_p(
    probs: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each row in token-id order: (token ids, weights), [N, k] each, where
    a token outside the row's top-k set or, within it, outside its top-p nucleus (the
    most likely tokens whose mass before them is under top_p) weighs 0."""
    vocab = probs.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    device = probs.device
    ps = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device)
    bounded = [kr for kr in ks if kr < vocab]
    k = min(vocab, max([_FIRST_K, *bounded]))
    open_rows = [i for i, kr in enumerate(ks) if kr == vocab]  # top-p alone
    while True:
        vals, ids = probs.topk(k, dim=-1)  # sorted, most likely first
        # Rows without top-k are exact once their candidates hold top_p of the mass.
        if k == vocab or not open_rows or bool((vals[open_rows].sum(-1) >= ps[open_rows]).all()):
            break
        k = min(vocab, k * 8)
    rank = torch.arange(k, device=device)[None, :]
    drop = rank >= torch.tensor(ks, device=device)[:, None]
    kept = vals.masked_fill(drop, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    # Nucleus over the top-k set: keep the smallest prefix whose mass reaches top_p
    # (the most likely token always stays).
    before = kept.cumsum(dim=-1) - kept
    drop |= before >= ps[:, None]
    weights = vals.masked_fill(drop, 0.0)
    order = ids.argsort(dim=-1)  # token-id order: the pick does not depend on tie order
    return ids.gather(-1, order), weights.gather(-1, order)


def token_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprobs | None] | None:
    """Per row, the sampled token's logprob and its `logprobs` most likely tokens' (None for
    rows that do not ask; None if none does). `logits` as `sample` saw them (processed);
    the distribution is theirs over the temperature (1 for greedy rows), before top-k/top-p."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    temps = [params[i].temperature or 1.0 for i in rows]
    t = torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
    found = _logprobs_of(
        _take(logits, rows) / t,
        [tokens[i] for i in rows],
        [params[i].logprobs or 0 for i in rows],
    )
    out: list[TokenLogprobs | None] = [None] * len(params)
    for i, lp in zip(rows, found, strict=True):
        out[i] = lp
    return out


def token_logprobs_rows(logits: torch.Tensor, k: int, tokens: list[int]) -> list[TokenLogprobs]:
    """Row i's log-softmax at tokens[i], and its k most likely tokens' (prompt logprobs:
    the model's own distribution, nothing processed)."""
    return _logprobs_of(logits, tokens, [k] * len(tokens))


def _logprobs_of(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    lp = torch.log_softmax(logits, dim=-1).clamp_(min=LOGPROB_FLOOR)
    chosen = lp.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    k = max(ks, default=0)
    if k:
        top_v, top_i = lp.topk(k, dim=-1)
        values, ids = top_v.tolist(), top_i.tolist()
    else:
        values = ids = [[] for _ in tokens]
    return [
        TokenLogprobs(logprob=c, top=tuple(zip(i[:n], v[:n], strict=True)))
        for c, i, v, n in zip(chosen, ids, values, ks, strict=True)
    ]
