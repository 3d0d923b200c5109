"""Per-request sampling parameters: a wire record (PrefillRequest, DecodeRequest carry it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0: disabled
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    max_tokens: int = Field(default=16, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The output index of this request's first sampled token: nonzero when a request is
    # continued elsewhere (re-prefilled after a node failure), so seeded noise continues.
    output_index_base: int = Field(default=0, ge=0, lt=2**31)

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
