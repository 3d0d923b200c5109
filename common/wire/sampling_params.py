"""Per-request sampling parameters: a wire record (PrefillRequest, DecodeRequest carry it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.wire.logprobs import MAX_TOP_LOGPROBS

MAX_CHOICES = 16
# What a node's 400 names as its `param` when the output constraint is at fault; the proxy
# renames it to the field of the client's request the constraint came from.
CONSTRAINT_PARAM = "sampling.structured"


class StructuredOutput(BaseModel):
    """A constraint on the output (xgrammar, common.engine.grammar): `json_object` any JSON
    object; `json` the JSON schema in `spec` (JSON text; `strict`: no properties or items
    beyond it); `regex`; `choice` one of the strings of the JSON list in `spec`; `grammar`
    an EBNF grammar (xgrammar's dialect, root rule `root`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json_object", "json", "regex", "choice", "grammar"]
    spec: str = Field(default="", max_length=1 << 20)
    strict: bool = True


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0: disabled
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    max_tokens: int = Field(default=16, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logit processors, applied before temperature (common.engine.logits_processors): the
    # OpenAI penalties over the output so far, vLLM's repetition penalty over prompt and
    # output, EOS and stop ids masked until min_tokens, and per-token additive biases.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    min_tokens: int = Field(default=0, ge=0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    # Report each sampled token's logprob and this many most likely tokens' (None: none).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Report each prompt token's logprob (given the tokens before it; the first has none)
    # and this many most likely tokens' there, computed during prefill (None: none). Such a
    # request computes its whole prompt: it takes nothing from the prefix cache.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The output must match this (the prefill node constrains the first token, the decode
    # node rebuilds the matcher from the tokens accepted so far).
    structured: StructuredOutput | None = None
    # Independent choices of one prompt: prefilled (and transferred) once, then the engine
    # that decodes forks the sequence (`for_choice` gives choice j its own seed).
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    # The output index of this request's first sampled token: nonzero when a request is
    # continued elsewhere (re-prefilled after a node failure), so seeded noise continues.
    output_index_base: int = Field(default=0, ge=0, lt=2**31)

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")
        return self

    def for_choice(self, j: int) -> SamplingParams:
        """Choice j's own parameters (one choice; j > 0 has a seed derived from this one's,
        so every choice is reproducible and the choices are independent draws)."""
        update: dict[str, object] = {"n": 1, "prompt_logprobs": None}
        if j and self.seed is not None:
            update["seed"] = (self.seed * 0x9E3779B1 + j) % (2**63 - 1)
        return self.model_copy(update=update)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (the processors look at this row's history)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processed(self) -> bool:
        """Whether any logit processor applies to this request's rows."""
        return self.penalized or self.min_tokens > 0 or bool(self.logit_bias)
