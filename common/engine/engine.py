"""The engine core both node roles drive: add, abort, step.

Threads: the *engine thread* (the one that calls `step`) owns the allocator, the scheduler
and the request records (or a thread holding the books lock during a forward pass:
`reserve_now`). Other threads talk to it through commands: `add_request`, `admit_prefilled`,
`abort_request`, `release_held` and `call` only enqueue, and `step` applies them first.
`state()` is the snapshot published last. Nothing in a step waits on I/O. Beside it:
reservations.py (decode role), pins.py (streamed KV), choices.py (n > 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from common.engine.block_allocator import BlockAllocator, BlockState
from common.engine.checks import RequestChecks, RequestError, check_block_owners
from common.engine.choices import ChoiceBook, fork_choices
from common.engine.commands import (
    AbortRequest,
    AddRequest,
    AdmitLanded,
    CallOnEngine,
    EngineCommand,
    ReleaseHeldKV,
)
from common.engine.config import EngineConfig
from common.engine.cuda_graphs import DecodeGraphs
from common.engine.device import resolve_device
from common.engine.grammar import GrammarError, Grammars
from common.engine.kv_cache import allocate_kv_cache, check_kernels
from common.engine.offline import Completion, run_offline, warm_up
from common.engine.pins import pin_computed
from common.engine.records import RequestRecord
from common.engine.reservations import Reservations
from common.engine.runner import ModelRunner
from common.engine.scheduler import OutputKind, ScheduledBatch, Scheduler, StepOutput
from common.engine.sequence import FinishReason, Sequence
from common.engine.snapshot import snapshot
from common.engine.timing import SlowestRecent, StepTiming, prefill_rate, step_time_bound
from common.model.config import ModelConfig
from common.model.weights import load_model
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams, StructuredOutput
from common.wire.stage import Stage
from kernels.dispatch import kernels_for

log = logging.getLogger(__name__)

STEP_MEMORY_S = 600.0  # how long the slowest step is remembered (step_time_max_s)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = resolve_device(config.device)
        self.model, self.weights_hash = load_model(
            config.model, config.dtype, self.device, int4=config.int4_weights
        )
        self.model_config: ModelConfig = self.model.config
        mc = self.model_config
        self.dtype = next(self.model.parameters()).dtype  # the model's (compute) dtype
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.kv_cache = allocate_kv_cache(config, mc, self.dtype, self.device)  # kv_cache.py
        self.block_bytes = self.kv_cache[0].numel() * self.kv_cache.element_size()
        self.allocator = BlockAllocator(self.kv_cache.shape[0])
        self.scheduler = Scheduler(
            self.allocator,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            mc.eos_token_ids,
            prefix_caching=config.enable_prefix_caching,
            # Everything else the KV of a block depends on: the same tokens under another
            # model, compute or cache dtype or block size are other bytes.
            cache_salt=(
                f"{self.weights_hash}/{self.dtype}/{self.kv_cache.dtype}/{config.block_size}".encode()
            ),
        )
        self.kernels = kernels_for(self.device, config.kernel_backend)
        check_kernels(self.kernels.name, self.kv_cache.dtype, self.dtype)
        log.info("kernels: %s on %s", self.kernels.name, self.device)
        self.runner = ModelRunner(
            self.model, self.kv_cache, config.block_size, self.kernels, mc.eos_token_ids
        )
        if config.cuda_graphs:  # (ValueError without CUDA and the Triton kernels)
            width = -(-self.max_model_len // config.block_size)
            self.runner.graphs = DecodeGraphs(
                self.model, self.kv_cache, self.kernels, config.max_num_seqs, width
            )
            self.runner.graphs.capture()
        self._inbox: deque[EngineCommand] = deque()
        self._records: dict[str, RequestRecord] = {}  # the engine thread writes
        # Ids submitted and not yet finished: the submitting thread adds, the engine thread
        # discards (single-adder, so check-then-add needs no lock).
        self._known_ids: set[str] = set()
        self._arrivals = 0
        self._snapshot: dict[str, object] = {}
        self.integrity_violations = 0  # found by check_integrity_when_idle
        self.prefill_tokens_per_s: float | None = None  # measured (timing.prefill_rate)
        # The warm-up's (cold) prefill rate: bounds the step time until one is measured.
        self.warm_up_prefill_tokens_per_s: float | None = None
        self._slowest_step = SlowestRecent(STEP_MEMORY_S)  # forward seconds
        # Called on the engine thread after every step that ran a batch (node metrics).
        self.on_step: Callable[[StepTiming], None] | None = None
        # Structured output's compiler; the tokenizer loads with it, on first use.
        self.grammars = Grammars(
            lambda: Tokenizer.from_dir(config.model), mc.vocab_size, mc.eos_token_ids
        )
        # The books (records, scheduler, allocator): the engine thread holds this lock for
        # each step but its forward pass, so that another thread may reserve blocks while
        # the model runs (`reserve_now`) instead of waiting for the step's end.
        self._books = threading.RLock()  # (re-entrant: a `call` runs under it)
        self._checks = RequestChecks(
            self.model_config.vocab_size,
            self.max_model_len,
            config.block_size,
            self.allocator.num_blocks * config.block_size,
            self.grammars,
        )
        self._choices = ChoiceBook()  # n > 1
        self._reservations = Reservations(
            self.allocator, self.scheduler, self._records, config.max_num_seqs
        )  # decode role
        self.scheduler.on_fork = self._fork
        self._publish()

    # -- commands (any thread) -------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        hold_kv: bool = False,
        stream_kv: bool = False,
        transfer: object | None = None,
    ) -> None:
        """Queue a request; raises RequestError if it can never be served.

        With `hold_kv` (prefill role) the request stops after its first token and
        its prompt KV blocks stay HELD until `release_held`. With `stream_kv` too, each
        full prompt block is pinned and reported (KV_COMPUTED) the step it is computed, and
        the record is kept (HELD, its pins) until `release_held` however the request ends.
        `transfer` is the node's record of the request's transfer (`RequestRecord.transfer`).
        """
        self.validate(prompt_token_ids, sampling)
        seq = self._new_seq(request_id, prompt_token_ids, sampling, hold_kv, stream_kv)
        self._constrain(seq)
        self._inbox.append(AddRequest(seq, transfer))

    def _new_seq(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        hold_kv: bool,
        stream_kv: bool,
    ) -> Sequence:
        if request_id in self._known_ids or request_id in self._records:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._known_ids.add(request_id)
        self._arrivals += 1
        return Sequence(request_id, token_ids, sampling, self._arrivals, hold_kv, stream_kv)

    def release_held(self, request_id: str) -> None:
        """Free a prefilled request's HELD blocks (transfer done, cancel, lease expiry)."""
        self._inbox.append(ReleaseHeldKV(request_id))

    def call(
        self, fn: Callable[[], object], done: Callable[[object, BaseException | None], None]
    ) -> None:
        """Run `fn` on the engine thread between steps; `done(result, error)` gets the outcome
        there (AsyncEngine.call turns it into an awaitable)."""
        self._inbox.append(CallOnEngine(fn, done))

    # -- decode role: destination blocks (engine thread) -------------------------

    def reserve_now(
        self,
        request_id: str,
        num_tokens: int,
        prompt_token_ids: list[int] | None = None,
        choices: int = 1,
    ) -> tuple[bool, list[int] | None]:
        """Any thread: `reserve` at once, if the engine thread is not using the books (it
        is idle, or a step's forward pass runs) and no command waits (commands apply in
        order): (True, its result). Else (False, None): reserve between steps (`call`).

        A decode node's reservation thus answers within the step it arrives in, and the
        KV moves while the model runs, rather than after the step (a decode step of a
        full batch takes 50-100 ms on this CPU)."""
        if not self._books.acquire(blocking=False):
            return False, None
        try:
            if self._inbox:
                return False, None
            return True, self.reserve(request_id, num_tokens, prompt_token_ids, choices)
        finally:
            self._books.release()

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        prompt_token_ids: list[int] | None = None,
        choices: int = 1,
    ) -> list[int] | None:
        """Reserve destination blocks for `num_tokens` of incoming KV, or None if full
        (engine thread, or a thread holding the books: `reserve_now`). Cached prompt
        blocks are shared, not reserved (`Reservations.reserve`)."""
        blocks = self._reservations.reserve(request_id, num_tokens, prompt_token_ids, choices)
        if blocks is not None:
            self._publish()
        return blocks

    def free_reserved(self, request_id: str) -> None:
        """Free a reservation whose transfer is quiescent (aborted, failed, peer dead)."""
        record = self._records.get(request_id)
        if record is not None and record.stage is Stage.RESERVED:
            self._free_kept(record)
            self._publish()

    def admit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        sampling: SamplingParams,
    ) -> None:
        """The KV of `prompt_token_ids` has landed in the request's reserved blocks:
        decode on from `first_token_id` in the running batch. The request's id is its
        reservation's (the RESERVED record becomes RUNNING)."""
        self._arrivals += 1
        seq = Sequence(request_id, [*prompt_token_ids, first_token_id], sampling, self._arrivals)
        seq.num_prompt_tokens = len(prompt_token_ids)
        self._constrain(seq)  # the matcher rebuilt from the tokens sampled elsewhere
        self._inbox.append(AdmitLanded(seq))

    def _constrain(self, seq: Sequence) -> None:
        """Give a constrained sequence its matcher, fed its output so far; RequestError if
        that output breaks the constraint."""
        spec = seq.sampling.structured
        if spec is None:
            return
        try:
            seq.matcher = self.grammars.matcher_for(spec, seq.outputs_so_far)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def record(self, request_id: str) -> RequestRecord | None:
        """The request's record, if the engine holds it (a read; safe from any thread)."""
        return self._records.get(request_id)

    def records(self) -> list[RequestRecord]:
        """Every record the engine holds, copied: safe from any thread (one C-level copy
        under the GIL; the engine thread may add or drop records meanwhile)."""
        return list(self._records.values())

    def stage_of(self, request_id: str) -> Stage | None:
        """Where the request is (QUEUED, RUNNING, HELD, RESERVED), or None if this engine
        does not know it. A snapshot, safe from any thread."""
        record = self._records.get(request_id)
        if record is not None:
            return record.stage
        return Stage.QUEUED if request_id in self._known_ids else None

    def abort_request(self, request_id: str, choice: int | None = None) -> None:
        """Abort the request (every choice), or with `choice` that choice only (n > 1:
        once the engine forked it; an ask before that is ignored)."""
        self._inbox.append(AbortRequest(request_id, choice))

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise RequestError if this engine can never serve the request (checks.py)."""
        self._checks.request(prompt_token_ids, sampling)

    def validate_prefilled(
        self,
        prompt_token_ids: list[int],
        first_token_id: int | None,
        sampling: SamplingParams,
        kv_num_tokens: int,
        kv_num_blocks: int,
    ) -> None:
        """`validate`, for a request prefilled elsewhere, plus what its KV handle claims."""
        self._checks.prefilled(
            prompt_token_ids, first_token_id, sampling, kv_num_tokens, kv_num_blocks
        )

    def compile_constraint(self, spec: StructuredOutput) -> None:
        """Compile `spec` (any thread; cached): RequestError if it does not compile."""
        self._checks.constraint(spec)

    def check_token(self, token_id: int) -> None:
        """A first token sampled elsewhere must be in this model's vocabulary."""
        self._checks.token(token_id)

    # -- the offline API --------------------------------------------------------

    def generate(
        self,
        prompts: Seq[list[int]],
        sampling: SamplingParams | Seq[SamplingParams],
        max_steps: int = 1_000_000,
        on_output: Callable[[StepOutput], None] | None = None,
    ) -> list[Completion]:
        """Run `prompts` to completion on the calling thread, batched as the engine
        schedules them; one Completion per prompt, in order. `on_output` sees each step's
        outputs as they come (to stream them). Nothing else may step this engine meanwhile
        (no engine thread). Raises RequestError if a prompt is refused."""
        return run_offline(self, prompts, sampling, max_steps, on_output)

    def warm_up(self) -> float:
        """Run each kind of step once before serving, leaving no trace (offline.warm_up);
        seconds taken. Call before the engine thread starts."""
        seconds = warm_up(self)
        self._publish()
        return seconds

    # -- the step (engine thread) ----------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """One step (engine thread): commands, schedule, forward, outputs. The books are
        locked throughout but for the forward, which reads only the batch's own blocks
        (what `reserve_now` may do meanwhile touches none of them)."""
        t0 = time.perf_counter()
        with self._books:
            outputs = self._apply_commands()
            t1 = time.perf_counter()
            batch = self.scheduler.schedule()
        t2 = time.perf_counter()
        sampled = self.runner.run(batch) if len(batch) else None  # the books are free
        t3 = time.perf_counter()
        with self._books:
            if sampled is not None:
                seconds = t3 - t2
                self._slowest_step.add(seconds)
                self.prefill_tokens_per_s = prefill_rate(
                    self.prefill_tokens_per_s, batch.num_tokens - batch.num_decode, seconds
                )
                outputs += self.scheduler.postprocess(
                    batch, sampled.tokens, sampled.logprobs, sampled.prompt_logprobs
                )
                outputs += pin_computed(
                    batch, self._records, self.allocator, self.config.block_size
                )
            outputs += self.scheduler.keepalives(t3)
            return self._finish_step(outputs, batch, (t0, t1, t2, t3))

    def _finish_step(
        self, outputs: list[StepOutput], batch: ScheduledBatch, stamps: tuple[float, ...]
    ) -> list[StepOutput]:
        """Records updated from the step's outputs, state published, the step's timing
        reported (`stamps`: started, commands applied, scheduled, forward done)."""
        for out in outputs:
            if out.kind is OutputKind.HELD:
                assert out.held_blocks is not None
                self._records[out.request_id].hold(out.held_blocks)
            elif out.finished:
                self._end(out.request_id)
        if self._choices:  # forget the choices of requests whose every choice ended
            self._choices.forget_ended(self._records.__contains__)
        self._publish()
        if len(batch) and self.on_step is not None:
            self.on_step(StepTiming.of(batch, stamps, self.runner.last_sample_s))
        return outputs

    def apply_commands(self) -> list[StepOutput]:
        """Apply queued commands (engine thread); the outputs of aborted requests."""
        with self._books:
            return self._apply_commands()

    def _apply_commands(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        applied = bool(self._inbox)
        while self._inbox:
            match self._inbox.popleft():
                case AddRequest(seq, transfer):
                    rec = RequestRecord(seq.request_id, seq, transfer=transfer)
                    self._records[seq.request_id] = rec
                    self.scheduler.add(seq)
                case AbortRequest(request_id, choice):
                    outputs += (
                        self._abort(request_id)
                        if choice is None
                        else self._abort_choice(request_id, choice)
                    )
                case ReleaseHeldKV(request_id):
                    record = self._records.get(request_id)
                    if record is not None and record.stage is Stage.HELD:
                        self._free_kept(record)
                case AdmitLanded(seq):
                    outputs += self._admit(seq)
                case CallOnEngine() as call:
                    call.run()
        if applied:
            self._publish()
        return outputs

    def _abort(self, request_id: str) -> list[StepOutput]:
        """Abort a request, every choice of it (n > 1) included."""
        outputs: list[StepOutput] = []
        for j, fid in enumerate(self._choices.pop(request_id), 1):
            outputs += self._abort_one(fid, j, request_id)
        return outputs + self._abort_one(request_id)

    def _abort_choice(self, request_id: str, choice: int) -> list[StepOutput]:
        """Abort one choice; one asked for before the fork ends at the fork."""
        target = self._choices.target(request_id, choice, request_id in self._records)
        if target is None:
            return []
        return self._abort_one(target, choice, request_id if choice else None)

    def _abort_one(
        self, request_id: str, choice: int = 0, route: str | None = None
    ) -> list[StepOutput]:
        record = self._records.get(request_id)
        if record is None:  # already finished (or aborted), or never added
            return []
        if record.seq is not None:
            self.scheduler.abort(record.seq)
            self._end(request_id)
            return [
                StepOutput(request_id, [], True, FinishReason.ABORT, choice=choice, route=route)
            ]
        if record.stage is Stage.HELD and not record.pinned:
            # Aborted by a caller that never saw the hold: nothing can be transferring
            # these blocks, since no one learned of them. (Pinned ones the node learned of:
            # it releases them once its writes are quiescent.)
            self._free_kept(record)
        return []

    def _end(self, request_id: str) -> None:
        """The request's sequence ended (finished, aborted): drop its record, unless it has
        pinned blocks a write may read (streamed KV): those stay kept, HELD, until released."""
        record = self._records.get(request_id)
        if record is not None and record.seq is None:
            return  # ended already (an abort's output): what it kept stays kept
        if record is not None and record.pinned:
            record.keep_pins()
            self._known_ids.discard(request_id)
            return
        self._forget(request_id)

    def _admit(self, seq: Sequence) -> list[StepOutput]:
        self._reservations.admit(seq)
        if seq.sampling.n == 1:
            return []
        self._fork(seq)  # the prompt's KV came once, for every choice
        ended = self.scheduler.stop_at_admission(seq)  # choice 0 ended at its first token
        outputs = [] if ended is None else [ended]
        for j in self._choices.take_early_ends(seq.request_id):
            if j or ended is None:
                outputs += self._abort_choice(seq.request_id, j)
        return outputs

    def _fork(self, parent: Sequence) -> None:
        """Make choices 1..n-1 of `parent` (common.engine.choices)."""

        def new_seq(fid: str, prompt: list[int], sampling: SamplingParams) -> Sequence:
            self._arrivals += 1
            fork = Sequence(fid, prompt, sampling, self._arrivals)
            self._constrain(fork)
            self._records[fid] = RequestRecord(fid, fork)
            self._known_ids.add(fid)
            return fork

        ids = fork_choices(
            parent, new_seq, self.allocator, self.scheduler, self.kv_cache, self.config.max_num_seqs
        )
        self._choices.add(parent.request_id, ids)

    def _free_kept(self, record: RequestRecord) -> None:
        """Free a HELD or RESERVED block set (and its pins) and drop its record."""
        state = BlockState.HELD if record.stage is Stage.HELD else BlockState.RESERVED
        self.allocator.free(record.blocks, state)
        self.allocator.free(record.pinned, BlockState.HELD)
        self._forget(record.request_id)

    def _forget(self, request_id: str) -> None:
        self._records.pop(request_id, None)
        self._choices.forget(request_id)
        self._known_ids.discard(request_id)

    # -- introspection ---------------------------------------------------------

    def state(self) -> dict[str, object]:
        """Blocks by state, requests by stage: the snapshot of the last step (any thread)."""
        return self._snapshot

    def _publish(self) -> None:
        self._snapshot = snapshot(
            self.allocator,
            self.scheduler,
            self._records.values(),
            {
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "step_time_max_s": step_time_bound(
                    self._slowest_step.max(),
                    self.config.max_num_batched_tokens,
                    self.prefill_tokens_per_s or self.warm_up_prefill_tokens_per_s,
                ),
                "integrity_violations": self.integrity_violations,
            },
        )

    def check_integrity_when_idle(self) -> bool:
        """`check_integrity`, run by the engine thread whenever it goes idle. A violation is
        logged with the books and counted (published in `state()`), not raised: serving
        goes on, and /metrics shows it."""
        try:
            with self._books:
                self.check_integrity()
        except AssertionError as e:
            self.integrity_violations += 1
            log.error("KV block books disagree when idle: %s; records %s", e, self._records)
            self._publish()
            return False
        return True

    def check_integrity(self) -> None:
        """The allocator's books balance and agree with who owns each block (engine thread).

        Raises AssertionError naming the books that disagree."""
        check_block_owners(self.allocator, self.scheduler.running, self._records.values())
