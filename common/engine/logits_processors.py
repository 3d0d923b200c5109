"""Logit processors: what a request's own history and biases do to its logits before sampling.

Applied in place, in vLLM's order, to the rows whose SamplingParams ask for any of them
(`SamplingParams.processed`); other rows are not touched and cost nothing:

1. min_tokens: while a request has generated fewer than `min_tokens` tokens, its EOS ids
   (unless `ignore_eos`) and its `stop_token_ids` get -inf;
2. logit_bias: each (token id, bias) pair is added (OpenAI: -100 bans, +100 forces);
3. repetition_penalty (CTRL, as `transformers`' RepetitionPenaltyLogitsProcessor and
   vLLM): every token of the prompt or the output so far has a positive logit divided by
   the penalty and a negative one multiplied by it;
4. frequency_penalty and presence_penalty (OpenAI's definition): over the output so far,
   `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.

Temperature, top-k and top-p follow in `sampling.sample`. The history is the sequence's
tokens, so a token is processed identically on the prefill node (its first token: no
output yet) and on the decode node (which holds the prompt and every output token since
the first). A request continued after a node failure carries its earlier outputs at the
end of its prompt; `output_index_base` says how many, and they count as output here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import torch

from common.wire.sampling_params import SamplingParams


def apply_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    num_prompt: Sequence[int],
    eos_token_ids: Iterable[int],
) -> torch.Tensor:
    """Process `logits` ([N, vocab], float) in place for the rows that ask for it.

    Row i's history is token_ids[i]: its first num_prompt[i] tokens are the prompt (less the
    `output_index_base` earlier outputs a continued request carries at its end), the rest
    the output so far. Returns `logits`.
    """
    rows = [i for i, p in enumerate(params) if p.processed]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    eos = tuple(eos_token_ids)
    # Where each row's output starts in its history.
    starts = {i: max(0, num_prompt[i] - params[i].output_index_base) for i in rows}
    _min_tokens(logits, params, token_ids, starts, eos, rows)
    _logit_bias(logits, params, rows, vocab)
    penalized = [i for i in rows if params[i].penalized]
    if penalized:
        _penalties(logits, params, token_ids, starts, penalized, vocab)
    return logits


def _min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    starts: dict[int, int],
    eos: tuple[int, ...],
    rows: list[int],
) -> None:
    r: list[int] = []
    t: list[int] = []
    vocab = logits.shape[-1]
    for i in rows:
        p = params[i]
        if len(token_ids[i]) - starts[i] >= p.min_tokens:
            continue
        banned = {*p.stop_token_ids, *(() if p.ignore_eos else eos)}
        banned = {b for b in banned if b < vocab}
        r += [i] * len(banned)
        t += banned
    if r:
        index = (_ids(r, logits.device), _ids(t, logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def _logit_bias(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int], vocab: int
) -> None:
    r: list[int] = []
    t: list[int] = []
    b: list[float] = []
    for i in rows:
        for tok, bias in params[i].logit_bias:
            if tok < vocab:  # (the proxy checks ids against the vocabulary)
                r.append(i)
                t.append(tok)
                b.append(bias)
    if r:
        index = (_ids(r, logits.device), _ids(t, logits.device))
        values = torch.tensor(b, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, values, accumulate=True)


def _penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    starts: dict[int, int],
    rows: list[int],
    vocab: int,
) -> None:
    """Repetition over each row's whole history, frequency/presence over its output: one
    scatter per kind over the flattened histories of the penalized rows."""
    device, dtype = logits.device, logits.dtype
    sub = logits[rows]  # a copy: written back once at the end
    rep = [j for j, i in enumerate(rows) if params[i].repetition_penalty != 1.0]
    if rep:
        hist = [token_ids[rows[j]] for j in rep]
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=device)
        seen[_row_index(hist, device), _ids(list(chain.from_iterable(hist)), device)] = True
        penalty = torch.tensor(
            [params[rows[j]].repetition_penalty for j in rep], dtype=dtype, device=device
        )[:, None]
        part = sub[rep]
        scaled = torch.where(part < 0, part * penalty, part / penalty)
        sub[rep] = torch.where(seen, scaled, part)
    additive = [
        j
        for j, i in enumerate(rows)
        if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0
    ]
    if additive:
        outs = [token_ids[rows[j]][starts[rows[j]] :] for j in additive]
        counts = torch.zeros(len(additive), vocab, dtype=dtype, device=device)
        flat = list(chain.from_iterable(outs))
        if flat:
            ones = torch.ones(len(flat), dtype=dtype, device=device)
            counts.index_put_((_row_index(outs, device), _ids(flat, device)), ones, accumulate=True)
            freq = torch.tensor(
                [params[rows[j]].frequency_penalty for j in additive], dtype=dtype, device=device
            )[:, None]
            pres = torch.tensor(
                [params[rows[j]].presence_penalty for j in additive], dtype=dtype, device=device
            )[:, None]
            sub[additive] -= freq * counts + pres * (counts > 0).to(dtype)
    logits[rows] = sub


def _row_index(lists: list[Sequence[int]], device: torch.device) -> torch.Tensor:
    """For flattened `lists`, the index of the list each element came from."""
    lengths = torch.tensor([len(x) for x in lists], device=device)
    return torch.repeat_interleave(torch.arange(len(lists), device=device), lengths)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
