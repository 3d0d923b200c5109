"""A request inside the engine: its tokens, KV blocks and lifecycle state."""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from common.wire.fsm import Transitions
from common.wire.logprobs import TokenLogprobs
from common.wire.node_messages import FinishReasonName
from common.wire.sampling_params import SamplingParams


class SeqStatus(str, Enum):
    WAITING = "waiting"  # queued, no blocks (new, or preempted for recompute)
    RUNNING = "running"  # has blocks, scheduled every step
    FINISHED = "finished"  # stopped (stop token, length) or aborted; blocks released


MOVES: Transitions[SeqStatus] = Transitions(
    "sequence",
    {
        SeqStatus.WAITING: {SeqStatus.RUNNING, SeqStatus.FINISHED},
        SeqStatus.RUNNING: {SeqStatus.WAITING, SeqStatus.FINISHED},
        SeqStatus.FINISHED: set(),
    },
)


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @property
    def wire_name(self) -> FinishReasonName:
        """The name node messages carry (`common.wire.node_messages.FinishReasonName`)."""
        return _WIRE_NAMES[self]


_WIRE_NAMES: dict[FinishReason, FinishReasonName] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival: int,
        hold_kv: bool = False,
        stream_kv: bool = False,
    ) -> None:
        if stream_kv and not hold_kv:
            raise ValueError(f"{request_id}: streamed KV is held KV")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.arrival = arrival
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        # Prefix caching: chained hashes of the full blocks of token_ids computed so far,
        # how many leading blocks of block_table are registered in the cache, and how many
        # prompt tokens the first schedule found cached (usage.cached_tokens).
        self.block_hashes: list[int] = []
        self.num_registered = 0
        self.num_cached_tokens = 0
        # While waiting: prompt tokens it will likely find cached (the queue estimate), and
        # how many of its block hashes the scheduler counts among the waiting ones.
        self.expected_cached = 0
        self.num_queued_hashes = 0
        self.finish_reason: FinishReason | None = None
        # sampling.prompt_logprobs: those of prompt tokens 1.. so far (one per position
        # computed; a recompute after preemption does not add them again).
        self.prompt_logprobs: list[TokenLogprobs] = []
        # sampling.structured: the xgrammar GrammarMatcher of the output so far (set by the
        # engine, fed each sampled token by the scheduler).
        self.matcher: Any = None
        # sampling.n > 1: choice j > 0 is a fork of choice 0 (its `parent_id`) that shares
        # its prompt blocks; `forked`: choice 0 made its forks.
        self.choice = 0
        self.parent_id: str | None = None
        self.forked = False
        self.num_preemptions = 0
        # Prefill role: after the first token, keep the prompt's KV blocks (HELD)
        # for transfer instead of decoding on.
        self.hold_kv = hold_kv
        # Prefill role, KV streamed while the prompt computes: each full prompt block is
        # pinned (an extra HELD reference) and reported as soon as a step completes it.
        self.stream_kv = stream_kv
        # Wall-clock seconds, for the request's trace and queue-wait metrics.
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None  # first scheduled (left the queue)
        self.times_reported = False

    def transition(self, new: SeqStatus) -> None:
        self.status = MOVES.move(self.request_id, self.status, new)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def outputs_so_far(self) -> list[int]:
        """The output tokens, those a continued request carries in its prompt first
        (`SamplingParams.output_index_base`)."""
        start = max(0, self.num_prompt_tokens - self.sampling.output_index_base)
        return self.token_ids[start:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
