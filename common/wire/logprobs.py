"""Per-token log probabilities: what the sampler reports for a request that asks
(`SamplingParams.logprobs`), carried by node messages to the proxy, which renders them.

A logprob is of the distribution the sampler drew from before its top-k/top-p filter:
log_softmax of the processed logits (logit bias, min_tokens, penalties) divided by the
temperature (1 when greedy). A token the processors banned (-inf) reports LOGPROB_FLOOR, as
OpenAI does (JSON has no -inf).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

LOGPROB_FLOOR = -9999.0
MAX_TOP_LOGPROBS = 20


class TokenLogprobs(BaseModel):
    """The sampled token's logprob and, when asked for, the most likely tokens'."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
