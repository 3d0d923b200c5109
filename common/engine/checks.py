"""What an engine checks before it takes a request, and the block-ownership books it checks
when idle: kept apart from the engine's step so that each reads on its own.

`RequestChecks` raises RequestError for a request this engine can never serve (the client's
fault); `check_block_owners` raises AssertionError naming books that disagree (ours).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from common.engine.block_allocator import BlockAllocator, BlockState
from common.engine.grammar import GrammarError, Grammars
from common.engine.records import RequestRecord
from common.engine.sequence import Sequence
from common.wire.sampling_params import CONSTRAINT_PARAM, SamplingParams, StructuredOutput
from common.wire.stage import Stage


class RequestError(ValueError):
    """A request the engine refuses (bad length, duplicate id): the client's fault.
    `param`: the request field at fault, as the node's API names it, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestChecks:
    vocab_size: int
    max_model_len: int
    block_size: int
    capacity_tokens: int  # KV tokens the whole cache holds
    grammars: Grammars  # structured output (its compiler loads on first use)

    def request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len}"
            )
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        total = min(n + sampling.max_tokens, self.max_model_len)
        if total > self.capacity_tokens:
            raise RequestError(
                f"prompt + max_tokens needs {total} tokens of KV; this node holds "
                f"{self.capacity_tokens}"
            )
        if sampling.structured is not None:
            self.constraint(sampling.structured)

    def constraint(self, spec: StructuredOutput) -> None:
        """The constraint compiles (xgrammar caches it)."""
        try:
            self.grammars.compile(spec)
        except GrammarError as e:
            raise RequestError(str(e), param=CONSTRAINT_PARAM) from None

    def prefilled(
        self,
        prompt_token_ids: list[int],
        first_token_id: int | None,
        sampling: SamplingParams,
        kv_num_tokens: int,
        kv_num_blocks: int,
    ) -> None:
        """`request`, for a request prefilled elsewhere, plus what its KV handle claims: its
        first token is in the vocabulary, its KV covers exactly the prompt, in as many blocks
        as this node's block size needs. (A first token that comes later, with streamed KV,
        is checked with `token` then.)"""
        self.request(prompt_token_ids, sampling)
        if first_token_id is not None:
            self.token(first_token_id)
        n = len(prompt_token_ids)
        if n + sampling.max_tokens > self.max_model_len:  # the proxy fits max_tokens first
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context of {self.max_model_len}"
            )
        if kv_num_tokens != n:
            raise RequestError(f"the KV handle holds {kv_num_tokens} tokens; the prompt has {n}")
        bs = self.block_size
        need = -(-n // bs)
        if kv_num_blocks != need:
            raise RequestError(
                f"the KV handle has {kv_num_blocks} blocks; {n} tokens at block size {bs} "
                f"need {need} (block sizes differ?)"
            )

    def token(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise RequestError(f"first_token_id must be in [0, {self.vocab_size})")


def check_block_owners(
    allocator: BlockAllocator, running: Iterable[Sequence], records: Iterable[RequestRecord]
) -> None:
    """The allocator's books balance, and every reference it counts has its owner, in the
    state it is held in: a running sequence (USED), or a kept HELD or RESERVED set. Shared
    blocks have one reference per owner; cached free blocks have none."""
    allocator.check_integrity()
    owners: dict[int, Counter[BlockState]] = defaultdict(Counter)
    for seq in running:
        for b in seq.block_table:
            owners[b][BlockState.USED] += 1
    for record in records:
        for b in record.pinned:
            owners[b][BlockState.HELD] += 1
        if record.seq is None:
            state = BlockState.HELD if record.stage is Stage.HELD else BlockState.RESERVED
            for b in record.blocks:
                owners[b][state] += 1
    referenced = (b for b in range(allocator.num_blocks) if allocator.ref_count(b))
    for b in set(referenced) | set(owners):
        held = dict(owners.get(b, {}))
        assert allocator.holders(b) == held, ("owners", b, allocator.holders(b), held)
