"""The engine core both node roles drive: add, abort, step.

`add_request` and `abort_request` may be called from any thread: they only
enqueue a command. `step` (one thread at a time) applies queued commands, then
schedules, runs the model and postprocesses. Nothing in a step waits on I/O.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from common.engine.block_allocator import BlockAllocator, BlockState
from common.engine.config import EngineConfig
from common.engine.runner import ModelRunner
from common.engine.scheduler import Scheduler, StepOutput
from common.engine.sequence import FinishReason, SeqStatus, Sequence
from common.model.config import ModelConfig
from common.model.weights import load_model
from common.wire.sampling_params import SamplingParams
from kernels.dispatch import kernels_for

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses (bad length, duplicate id): the client's fault."""


@dataclass(frozen=True)
class Completion:
    """One prompt's result from `LLMEngine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # the generated tokens, a stop token included as the engine emits it
    finish_reason: FinishReason


@dataclass(frozen=True)
class _Add:
    seq: Sequence


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ReleaseHeld:
    request_id: str


@dataclass(frozen=True)
class _AdmitPrefilled:
    seq: Sequence


_Command = _Add | _Abort | _ReleaseHeld | _AdmitPrefilled


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
        self.kernels = kernels_for(config.device, config.kernel_backend)
        log.info("kernels: %s on %s", self.kernels.name, config.device)
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.kernels)
        self._inbox: deque[_Command] = deque()
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self._lock = threading.Lock()  # guards _arrivals and the id set below
        self._known_ids: set[str] = set()
        # Guards the allocator and scheduler: the engine thread holds it while it
        # schedules and postprocesses (not during the forward); node code holds it
        # to reserve or free destination blocks.
        self._alloc_lock = threading.Lock()
        self.held: dict[str, list[int]] = {}  # prefill role: prompt KV kept for transfer
        self.reserved: dict[str, list[int]] = {}  # decode role: destinations of transfers

    # -- commands (any thread) -------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        hold_kv: bool = False,
    ) -> None:
        """Queue a request; raises RequestError if it can never be served.

        With `hold_kv` (prefill role) the request stops after its first token and
        its prompt KV blocks stay HELD until `release_held`.
        """
        self.validate(prompt_token_ids, sampling)
        self._inbox.append(_Add(self._new_seq(request_id, prompt_token_ids, sampling, hold_kv)))

    def _new_seq(
        self, request_id: str, token_ids: list[int], sampling: SamplingParams, hold_kv: bool
    ) -> Sequence:
        with self._lock:
            if request_id in self._known_ids:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._known_ids.add(request_id)
            self._arrivals += 1
            return Sequence(request_id, token_ids, sampling, self._arrivals, hold_kv)

    def release_held(self, request_id: str) -> None:
        """Free a prefilled request's HELD blocks (transfer done, cancel, lease expiry)."""
        self._inbox.append(_ReleaseHeld(request_id))

    # -- decode role: destination blocks (any thread) ----------------------------

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Reserve destination blocks for `num_tokens` of incoming KV, or None if full.

        Keeps the scheduler's watermark free so running sequences can still grow,
        and counts reservations against max_num_seqs.
        """
        need = -(-num_tokens // self.config.block_size)
        with self._alloc_lock:
            busy = len(self.scheduler.running) + len(self.reserved)
            if request_id in self.reserved or busy >= self.config.max_num_seqs:
                return None
            if not self.allocator.can_allocate(need + self.scheduler.watermark):
                return None
            blocks = self.allocator.allocate(need, BlockState.RESERVED)
            self.reserved[request_id] = blocks
            return blocks

    def free_reserved(self, request_id: str) -> None:
        """Free a reservation whose transfer is quiescent (aborted, failed, peer dead)."""
        with self._alloc_lock:
            blocks = self.reserved.pop(request_id, None)
            if blocks:
                self.allocator.free(blocks)

    def admit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        sampling: SamplingParams,
    ) -> None:
        """The KV of `prompt_token_ids` has landed in the request's reserved blocks:
        decode on from `first_token_id` in the running batch."""
        seq = self._new_seq(request_id, [*prompt_token_ids, first_token_id], sampling, False)
        seq.num_prompt_tokens = len(prompt_token_ids)
        self._inbox.append(_AdmitPrefilled(seq))

    def stage_of(self, request_id: str) -> str | None:
        """Where the request is: "queued" (not scheduled yet, or preempted), "running", or
        None if this engine does not know it. A snapshot, safe from any thread."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            return "running" if seq.status is SeqStatus.RUNNING else "queued"
        with self._lock:
            return "queued" if request_id in self._known_ids else None

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

    # -- the offline API --------------------------------------------------------

    def generate(
        self,
        prompts: Seq[list[int]],
        sampling: SamplingParams | Seq[SamplingParams],
        max_steps: int = 1_000_000,
    ) -> list[Completion]:
        """Run `prompts` to completion on the calling thread, batched as the engine
        schedules them; one Completion per prompt, in order. Nothing else may step this
        engine meanwhile (no engine thread). Raises RequestError if a prompt is refused."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [f"offline-{uuid.uuid4().hex}" for _ in prompts]
        for rid, prompt, sp in zip(ids, prompts, params, strict=True):
            self.add_request(rid, list(prompt), sp)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        reasons: dict[str, FinishReason] = {}
        for _ in range(max_steps):
            if len(reasons) == len(ids):
                break
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished and out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
        else:
            raise RuntimeError(f"generate: not finished after {max_steps} steps")
        return [
            Completion(rid, list(p), tokens[rid], reasons[rid])
            for rid, p in zip(ids, prompts, strict=True)
        ]

    # -- the step (engine thread) ----------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        with self._alloc_lock:
            outputs = self._apply_commands()
            batch = self.scheduler.schedule()
        if len(batch):
            sampled = self.runner.run(batch)
            with self._alloc_lock:
                outputs += self.scheduler.postprocess(batch, sampled)
        for out in outputs:
            if out.held_blocks is not None:
                self.held[out.request_id] = out.held_blocks
                self._seqs.pop(out.request_id, None)
            elif out.finished:
                self._forget(out.request_id)
        return outputs

    def _apply_commands(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        while self._inbox:
            match self._inbox.popleft():
                case _Add(seq):
                    self._seqs[seq.request_id] = seq
                    self.scheduler.add(seq)
                case _Abort(request_id):
                    seq = self._seqs.pop(request_id, None)
                    if seq is not None:  # else already finished (or aborted), or never added
                        self.scheduler.abort(seq)
                        outputs.append(StepOutput(request_id, [], True, FinishReason.ABORT))
                    elif request_id in self.held:
                        # Aborted by a caller that never saw the hold: nothing can be
                        # transferring these blocks, since no one learned of them.
                        self.allocator.free(self.held.pop(request_id))
                        self._forget(request_id)
                case _ReleaseHeld(request_id):
                    blocks = self.held.pop(request_id, None)
                    if blocks is not None:
                        self.allocator.free(blocks)
                        self._forget(request_id)
                case _AdmitPrefilled(seq):
                    self._admit(seq)
        return outputs

    def _admit(self, seq: Sequence) -> None:
        blocks = self.reserved.pop(seq.request_id)
        self.allocator.transition(blocks, BlockState.USED)
        seq.block_table = blocks
        seq.num_computed_tokens = seq.num_tokens - 1  # all but the first token's KV
        seq.scheduled_time = time.time()
        self._seqs[seq.request_id] = seq
        self.scheduler.add_running(seq)

    def _forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        with self._lock:
            self._known_ids.discard(request_id)

    # -- introspection ---------------------------------------------------------

    def state(self) -> dict[str, object]:
        with self._alloc_lock:
            return {
                "blocks": self.allocator.counts(),
                "requests": {
                    "waiting": len(self.scheduler.waiting),
                    "running": len(self.scheduler.running),
                    "held": len(self.held),
                    "reserved": len(self.reserved),
                },
                "preemptions": self.scheduler.num_preemptions,
            }

    def check_integrity(self) -> None:
        """The allocator's books balance and agree with who owns each block."""
        with self._alloc_lock:
            self.allocator.check_integrity()
            counts = self.allocator.counts()
            owned = sum(len(s.block_table) for s in self.scheduler.running)
            assert owned == counts["used"], (owned, counts)
            assert sum(map(len, self.held.values())) == counts["held"], counts
            assert sum(map(len, self.reserved.values())) == counts["reserved"], counts
