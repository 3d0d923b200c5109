"""The offline API (`LLMEngine.generate`): prompts run to completion on the calling thread;
and the warm-up before serving, which runs that way."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from common.engine.block_allocator import BlockAllocator
from common.engine.config import EngineConfig
from common.engine.scheduler import Scheduler, StepOutput
from common.engine.sequence import FinishReason
from common.model.config import ModelConfig
from common.wire.logprobs import TokenLogprobs
from common.wire.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    """One prompt's result from `LLMEngine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # the generated tokens, a stop token included as the engine emits it
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] | None = None  # one per token, if the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., if asked
    # sampling.n > 1: choices 1.. (token ids and finish reason each); this is choice 0.
    more_choices: list[tuple[list[int], FinishReason]] | None = None


class _Engine(Protocol):
    def add_request(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> None: ...
    def step(self) -> list[StepOutput]: ...


def run_offline(
    engine: _Engine,
    prompts: Seq[list[int]],
    sampling: SamplingParams | Seq[SamplingParams],
    max_steps: int,
    on_output: Callable[[StepOutput], None] | None,
) -> list[Completion]:
    """`LLMEngine.generate`: add `prompts`, step until every choice of each finished."""
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    ids = [f"offline-{uuid.uuid4().hex}" for _ in prompts]
    for rid, prompt, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, list(prompt), sp)
    want = {(rid, j) for rid, sp in zip(ids, params, strict=True) for j in range(sp.n)}
    tokens: dict[tuple[str, int], list[int]] = {key: [] for key in want}
    reasons: dict[tuple[str, int], FinishReason] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in ids}
    prompt_lps: dict[str, list[TokenLogprobs] | None] = dict.fromkeys(ids)
    for _ in range(max_steps):
        if len(reasons) == len(want):
            break
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            key = (out.route or out.request_id, out.choice)
            tokens[key] += out.new_token_ids
            if out.choice == 0:
                logprobs[out.request_id] += out.logprobs or []
            if out.prompt_logprobs is not None:
                prompt_lps[out.request_id] = out.prompt_logprobs
            if out.finished and out.finish_reason is not None:
                reasons[key] = out.finish_reason
    else:
        raise RuntimeError(f"generate: not finished after {max_steps} steps")
    done = []
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        more = [(tokens[rid, j], reasons[rid, j]) for j in range(1, sp.n)] or None
        lps, plps = logprobs[rid] or None, prompt_lps[rid]
        done.append(Completion(rid, list(p), tokens[rid, 0], reasons[rid, 0], lps, plps, more))
    return done


class _Warmable(Protocol):  # what of LLMEngine the warm-up touches
    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    allocator: BlockAllocator
    scheduler: Scheduler
    device: torch.device
    prefill_tokens_per_s: float | None
    warm_up_prefill_tokens_per_s: float | None

    def generate(
        self, prompts: Seq[list[int]], sampling: Seq[SamplingParams]
    ) -> list[Completion]: ...


def warm_up(engine: _Warmable) -> float:
    """`LLMEngine.warm_up`: each kind of step once, a prefill of more than one block with a
    decode batch behind it, greedy and sampled rows, so that the first request does not pay
    for first use (Triton on CUDA compiles each kernel variant then; the CPU warms its
    allocator and oneDNN's kernels). Leaves no trace: the cached blocks are forgotten and
    every counter and measurement (evictions, KV event numbers, prefix hit counts,
    preemptions, the prefill rate) is restored; the prefill rate it measured is kept apart,
    for the step-time bound alone. Seconds taken."""
    started = time.perf_counter()
    vocab = engine.model_config.vocab_size
    n = max(1, min(2 * engine.config.block_size + 1, engine.max_model_len - 4))
    prompts = [[(7 * i + 3) % vocab for i in range(n)], [1 % vocab, 2 % vocab]]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(
        temperature=0.8, top_k=8, top_p=0.9, seed=0, max_tokens=3, ignore_eos=True
    )
    a, sched = engine.allocator, engine.scheduler
    kept = (a.evictions, a.event_no, sched.prefix_queries, sched.prefix_hits,
            sched.num_preemptions, engine.prefill_tokens_per_s)  # fmt: skip
    engine.generate(prompts, [greedy, sampled])
    a.reset_cache()
    # What the warm-up measured is not the node's: a cold first prefill is no prefill
    # rate for a router to plan with (the proxy places prompts by it). It does bound how
    # long the node's first full prefill chunk may take (`step_time_max_s`, the proxy's
    # stall timeout), which before any real prefill is otherwise unknown: a first chunk
    # of over 5 s (a big model on a CPU) ended every stream it held up.
    engine.warm_up_prefill_tokens_per_s = engine.prefill_tokens_per_s
    (a.evictions, a.event_no, sched.prefix_queries, sched.prefix_hits,
     sched.num_preemptions, engine.prefill_tokens_per_s) = kept  # fmt: skip
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - started
