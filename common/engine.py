"""The engine core both node roles drive: add, abort, step.

`add_request` and `abort_request` may be called from any thread: they only
enqueue a command. `step` (one thread at a time) applies queued commands, then
schedules, runs the model and postprocesses. Nothing in a step waits on I/O.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import torch

from common.block_allocator import BlockAllocator
from common.config import EngineConfig
from common.model_config import ModelConfig
from common.model_runner import ModelRunner
from common.sampling import SamplingParams
from common.scheduler import Scheduler, StepOutput
from common.sequence import FinishReason, Sequence
from common.weights import load_model

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses (bad length, duplicate id): the client's fault."""


@dataclass(frozen=True)
class _Add:
    seq: Sequence


@dataclass(frozen=True)
class _Abort:
    request_id: str


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model, self.weights_hash = load_model(config.model, config.dtype, config.device)
        self.model_config: ModelConfig = self.model.config
        mc = self.model_config
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        block_shape = (mc.num_layers, 2, config.block_size, mc.num_kv_heads, mc.head_dim)
        block_bytes = torch.Size(block_shape).numel() * self.dtype.itemsize
        num_blocks = config.num_blocks or max(1, config.kv_cache_memory // block_bytes)
        # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            (num_blocks, *block_shape), dtype=self.dtype, device=config.device
        )
        self.block_bytes = block_bytes
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(
            self.allocator,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            mc.eos_token_ids,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size)
        self._inbox: deque[_Add | _Abort] = deque()
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self._lock = threading.Lock()  # guards _arrivals and the id set below
        self._known_ids: set[str] = set()

    # -- commands (any thread) -------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """Queue a request; raises RequestError if it can never be served."""
        self.validate(prompt_token_ids, sampling)
        with self._lock:
            if request_id in self._known_ids:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._known_ids.add(request_id)
            self._arrivals += 1
            seq = Sequence(request_id, prompt_token_ids, sampling, self._arrivals)
        self._inbox.append(_Add(seq))

    def abort_request(self, request_id: str) -> None:
        self._inbox.append(_Abort(request_id))

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        total = min(n + sampling.max_tokens, self.max_model_len)
        capacity = self.allocator.num_blocks * self.config.block_size
        if total > capacity:
            raise RequestError(
                f"prompt + max_tokens needs {total} tokens of KV; this node holds {capacity}"
            )

    # -- the step (engine thread) ----------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        outputs = self._apply_commands()
        batch = self.scheduler.schedule()
        if len(batch):
            sampled = self.runner.run(batch)
            outputs += self.scheduler.postprocess(batch, sampled)
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _apply_commands(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, _Add):
                self._seqs[cmd.seq.request_id] = cmd.seq
                self.scheduler.add(cmd.seq)
            else:
                seq = self._seqs.get(cmd.request_id)
                if seq is None:
                    continue  # already finished, or never added
                self.scheduler.abort(seq)
                outputs.append(StepOutput(seq.request_id, [], True, FinishReason.ABORT))
        return outputs

    def _forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        with self._lock:
            self._known_ids.discard(request_id)

    # -- introspection ---------------------------------------------------------

    def state(self) -> dict[str, object]:
        return {
            "blocks": self.allocator.counts(),
            "requests": {
                "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running),
            },
            "preemptions": self.scheduler.num_preemptions,
        }

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        owned = sum(len(s.block_table) for s in self.scheduler.running)
        used = self.allocator.counts()["used"]
        assert owned == used, (owned, used)
