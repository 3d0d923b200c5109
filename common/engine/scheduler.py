"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step gives every scheduled sequence a number of new tokens to compute:
one for a decoding sequence, a chunk for one still prefilling (a new prompt, or
a preempted sequence recomputing its tokens). Running sequences go first, oldest
first, within a per-step token budget; waiting ones join while budget, sequence
slots and blocks allow. When a running sequence needs a block and none is free,
the newest running sequence is preempted: its blocks are freed and it waits to be
recomputed. A sequence samples a token when its step computes its last token.

Prefix caching (on unless `prefix_caching=False`): when a sequence without blocks is
scheduled (new, or preempted), the longest run of its full blocks already in the cache is
shared instead of computed, always leaving at least one token to compute so the step
samples. Each block is registered under its chained hash once its tokens are computed.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from common.engine.block_allocator import BlockAllocator, BlockState, block_hashes
from common.engine.sequence import FinishReason, SeqStatus, Sequence
from common.wire.logprobs import TokenLogprobs

# How often a preempted request's stream hears from the engine while it waits: a silence
# of at most this plus a step, well within the proxy's stall timeout (5 s by default, and
# 1 s in the tests that shorten it).
KEEPALIVE_S = 0.5


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # decode (1 token) entries first
    num_new: list[int] = field(default_factory=list)
    num_decode: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class OutputKind(str, Enum):
    TOKENS = "tokens"  # new tokens of a request (the last output of a request has finished)
    HELD = "held"  # prefill role: the first token; the prompt's KV blocks are now HELD
    # prefill role, streamed KV: these full prompt blocks are computed and pinned (not final)
    KV_COMPUTED = "kv_computed"
    ENGINE_DEAD = "engine_dead"  # the engine thread died (AsyncEngine's last output)
    # No tokens: a preempted request that streamed tokens before is waiting to run again
    # (queued, or recomputing); its stream hears the engine is alive (`Scheduler.keepalives`).
    WAITING = "waiting"


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    kind: OutputKind = OutputKind.TOKENS
    # HELD only: the prompt's KV blocks, kept for transfer (the request stops here to be
    # decoded elsewhere: finished, no finish_reason).
    held_blocks: list[int] | None = None
    # On a request's first output only: (arrival, first scheduled), wall-clock seconds,
    # and how many prompt tokens the prefix cache saved it (usage.cached_tokens).
    times: tuple[float, float] | None = None
    num_cached_tokens: int | None = None
    # KV_COMPUTED only: the newly computed full prompt blocks, in prompt order, following
    # those reported before (pinned: held for the node until it releases the request).
    computed_blocks: list[int] | None = None
    # One per new token, when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # First output only, when the request asked: those of prompt tokens 1.. (the first
    # prompt token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # sampling.n > 1: which choice this is, and (choices > 0) the request it belongs to,
    # by whose id its outputs are delivered.
    choice: int = 0
    route: str | None = None

    def __post_init__(self) -> None:
        if (self.held_blocks is not None) != (self.kind is OutputKind.HELD):
            raise ValueError("held_blocks is set exactly on HELD outputs")
        if (self.computed_blocks is not None) != (self.kind is OutputKind.KV_COMPUTED):
            raise ValueError("computed_blocks is set exactly on KV_COMPUTED outputs")
        ends = self.kind in (OutputKind.HELD, OutputKind.ENGINE_DEAD)
        if ends != self.finished and self.kind is not OutputKind.TOKENS:
            raise ValueError(
                f"a {self.kind.value} output {'ends' if ends else 'continues'} its request"
            )


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        prefix_caching: bool = True,
        cache_salt: bytes = b"",
    ) -> None:
        self.allocator = allocator
        self.prefix_caching = prefix_caching
        self.cache_salt = cache_salt
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of them, found cached
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # Called with a sequence of n > 1 choices at its first token (the engine forks it).
        self.on_fork: Callable[[Sequence], None] | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        # Admission keeps a few blocks back so running sequences can grow.
        self.watermark = max(1, allocator.num_blocks // 100)
        self.num_preemptions = 0
        # Full-block hashes of the waiting prompts (counted): a later prompt with the same
        # prefix will find it cached once the earlier one is computed.
        self._queued_hashes: Counter[int] = Counter()
        self._keepalive_at = 0.0  # monotonic time of the next keepalives

    # -- queries ---------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def keepalives(self, now: float) -> list[StepOutput]:
        """WAITING outputs, at most one per sequence every KEEPALIVE_S, for the preempted
        sequences that streamed tokens and have not caught up yet (waiting, or recomputing
        what they had). Their streams would otherwise go silent for as long as the wait for
        free blocks lasts, and a silent stream is taken for a hung node (the proxy's stall
        timeout); the engine stepping is what says the node is alive."""
        if now < self._keepalive_at:
            return []
        self._keepalive_at = now + KEEPALIVE_S
        waiting = OutputKind.WAITING
        return [
            StepOutput(s.request_id, [], False, kind=waiting, choice=s.choice, route=s.parent_id)
            for s in (*self.waiting, *self.running)
            if s.num_preemptions and s.num_output_tokens and s.num_uncomputed > 1
        ]

    # -- requests --------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.expected_cached = self._expected_cached(seq)
        self.waiting.append(seq)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: the waiting prompts' less what the prefix cache
        (or an earlier waiting prompt) will likely supply, and the rest of prompts mid-
        prefill. What a router divides by the prefill rate."""
        waiting = sum(max(0, s.num_uncomputed - s.expected_cached) for s in self.waiting)
        return waiting + sum(s.num_uncomputed for s in self.running if s.num_uncomputed > 1)

    def _expected_cached(self, seq: Sequence) -> int:
        """Tokens of a new prompt's prefix that are cached now or belong to a prompt waiting
        before it (an estimate, fixed at arrival: the cache may change until it runs)."""
        if not self.prefix_caching:
            return 0
        usable = (seq.num_tokens - 1) // self.block_size
        if usable <= 0:
            return 0
        self._hash_blocks(seq, usable * self.block_size)
        hashes = seq.block_hashes[:usable]
        n = len(self.allocator.lookup(hashes))
        while n < usable and hashes[n] in self._queued_hashes:
            n += 1
        self._queued_hashes.update(hashes)
        seq.num_queued_hashes = usable
        return n * self.block_size

    def _left_waiting(self, seq: Sequence) -> None:
        counts = self._queued_hashes
        for h in seq.block_hashes[: seq.num_queued_hashes]:
            counts[h] -= 1
            if counts[h] <= 0:
                del counts[h]
        seq.num_queued_hashes = 0

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in its blocks (it decodes next step)."""
        seq.transition(SeqStatus.RUNNING)
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def abort(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self._left_waiting(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        self._finish(seq, FinishReason.ABORT)

    # -- the step --------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        entries: list[tuple[Sequence, int]] = []
        # Decoding sequences first (they bound inter-token latency), then chunks of
        # sequences still prefilling; oldest first within each group.
        pending = [s for s in self.running if s.num_uncomputed == 1]
        pending += [s for s in self.running if s.num_uncomputed != 1]
        pending.reverse()  # pop() takes the next one to schedule
        while pending and budget > 0:
            seq = pending.pop()
            n = min(seq.num_uncomputed, budget)
            need = self.blocks_needed(seq, seq.num_computed_tokens + n)
            if not self._make_room(seq, pending, need):
                continue  # seq itself was preempted
            self._grow(seq, seq.num_computed_tokens + n)
            entries.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            cached = len(hits) * self.block_size
            n = min(seq.num_uncomputed - cached, budget)
            reserve = self.watermark if self.running else 0
            need = -(-(seq.num_computed_tokens + cached + n) // self.block_size) - len(hits)
            revived = sum(1 for b in hits if self.allocator.is_cached_free(b))
            if not self.allocator.can_allocate(need + revived + reserve):
                break
            self.waiting.popleft()
            self._left_waiting(seq)
            if hits:
                self.allocator.share(hits)
                seq.block_table = hits
                seq.num_registered = len(hits)  # (they are registered already)
                seq.num_computed_tokens = cached
            if seq.scheduled_time is None:  # its first schedule: what the cache saved it
                seq.num_cached_tokens = cached
                self.prefix_queries += seq.num_prompt_tokens
                self.prefix_hits += cached
            seq.transition(SeqStatus.RUNNING)
            if seq.scheduled_time is None:
                seq.scheduled_time = time.time()
            self._grow(seq, seq.num_computed_tokens + n)
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            entries.append((seq, n))
            budget -= n
        return self._order(entries)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a sequence without blocks may start from (never all of its
        tokens: the step must compute one to sample)."""
        if not self.prefix_caching or seq.block_table or seq.num_computed_tokens:
            return []
        if seq.sampling.prompt_logprobs is not None:
            return []  # every prompt position is computed for its logprobs
        usable = (seq.num_tokens - 1) // self.block_size
        if usable <= 0:
            return []
        self._hash_blocks(seq, usable * self.block_size)
        return self.allocator.lookup(seq.block_hashes[:usable])

    def cached_prompt_blocks(self, token_ids: list[int]) -> list[int]:
        """The cached blocks holding the longest prefix of a prompt's full blocks, short of
        the block with its last token (decode role: those need no transfer)."""
        if not self.prefix_caching:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        hashes = block_hashes(
            token_ids[: usable * self.block_size], self.block_size, self.cache_salt
        )
        return self.allocator.lookup(hashes)

    def _hash_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over its full blocks within its first num_tokens."""
        if len(seq.block_hashes) < num_tokens // self.block_size:
            seq.block_hashes = block_hashes(
                seq.token_ids[:num_tokens], self.block_size, self.cache_salt, seq.block_hashes
            )

    def register_computed(self, seq: Sequence) -> None:
        """Name the sequence's full, computed blocks in the cache (after a step)."""
        if not self.prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered:
            return
        self._hash_blocks(seq, full * self.block_size)
        for i in range(seq.num_registered, full):
            self.allocator.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered = full

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: list[int],
        logprobs: list[TokenLogprobs | None] | None = None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> list[StepOutput]:
        """Advance computed counts, append sampled tokens, finish stopped sequences.

        `sampled` holds one token per entry whose step reached its last token, in
        batch order; `logprobs` (if any row asked) one entry per sampled token;
        `prompt_logprobs` the prompt positions computed this step, of the sequences that
        asked (their first output carries them all).
        """
        outputs: list[StepOutput] = []
        positions = prompt_logprobs or {}
        for seq in batch.seqs if positions else ():  # (nothing to look at, most steps)
            found = positions.get(seq.request_id)
            if found is not None:  # (chunks come in order; a recompute adds nothing)
                start, computed = found
                seq.prompt_logprobs += computed[max(0, len(seq.prompt_logprobs) - start) :]
        it = iter(sampled)
        lps = iter(logprobs) if logprobs is not None else None
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            seq.num_computed_tokens += n
            self.register_computed(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last one
            token = next(it)
            lp = next(lps) if lps is not None else None
            token_lps = None if lp is None else [lp]
            seq.token_ids.append(token)
            if seq.matcher is not None and not seq.matcher.is_terminated():
                seq.matcher.accept_token(token)
            if seq.sampling.n > 1 and not seq.forked and not seq.hold_kv and self.on_fork:
                self.on_fork(seq)  # before it may finish: the forks share its blocks
            # A prefill of several choices holds its KV whatever its first token: the decode
            # node forks the other choices from it, and finishes choice 0 there if it stops.
            several = seq.hold_kv and seq.sampling.n > 1
            reason = None if several else self._stop_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            elif seq.hold_kv:
                held = self._hold(seq)
                kind = OutputKind.HELD
                outputs.append(
                    StepOutput(seq.request_id, [token], True, None, kind, held, logprobs=token_lps)
                )
                _first_output(outputs[-1], seq)
                continue
            out = StepOutput(
                seq.request_id,
                [token],
                reason is not None,
                reason,
                logprobs=token_lps,
                choice=seq.choice,
                route=seq.parent_id,
            )
            _first_output(out, seq)
            outputs.append(out)
        return outputs

    def _hold(self, seq: Sequence) -> list[int]:
        """Stop `seq` after its first token, keeping its prompt KV blocks as HELD."""
        self.running.remove(seq)
        held, seq.block_table = seq.block_table, []
        self.allocator.transition(held, BlockState.HELD, BlockState.USED)
        seq.transition(SeqStatus.FINISHED)
        return held

    # -- internals -------------------------------------------------------------

    def _make_room(self, seq: Sequence, pending: list[Sequence], need: int) -> bool:
        """Preempt the newest unscheduled running sequences until `need` blocks fit.

        Candidates are `seq` and the sequences still `pending` this step. Returns
        False if `seq` itself had to be preempted.
        """
        while not self.allocator.can_allocate(need):
            victim = max([seq, *pending], key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return False
            pending.remove(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table, BlockState.USED)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_registered = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.transition(SeqStatus.WAITING)
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need:
            seq.block_table += self.allocator.allocate(need)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table, BlockState.USED)
            seq.block_table = []
        seq.finish_reason = reason
        seq.transition(SeqStatus.FINISHED)

    def stop_at_admission(self, seq: Sequence) -> StepOutput | None:
        """Decode role, several choices: finish running `seq` now if the first token it
        came with (sampled where it was prefilled, which held its KV for the other choices)
        already ends it; its finishing output (no tokens: the first was sent), if it does."""
        reason = self._stop_reason(seq, seq.token_ids[-1])
        if reason is None:
            return None
        self.running.remove(seq)
        self._finish(seq, reason)
        out = StepOutput(seq.request_id, [], True, reason)
        _first_output(out, seq)
        return out

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        sp = seq.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.matcher is not None and seq.matcher.is_terminated():
            return FinishReason.STOP  # the constraint is complete: nothing more may follow
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _order(entries: list[tuple[Sequence, int]]) -> ScheduledBatch:
        batch = ScheduledBatch()
        decode = [(s, n) for s, n in entries if n == 1]
        prefill = [(s, n) for s, n in entries if n != 1]
        for s, n in decode + prefill:
            batch.seqs.append(s)
            batch.num_new.append(n)
        batch.num_decode = len(decode)
        return batch


def _first_output(out: StepOutput, seq: Sequence) -> None:
    """On the first output of `seq`: its (arrival, first scheduled) times, its cache hit and
    its prompt logprobs, if it asked."""
    if seq.times_reported:
        return
    seq.times_reported = True
    out.times = seq.arrival_time, seq.scheduled_time or seq.arrival_time
    out.num_cached_tokens = seq.num_cached_tokens
    if seq.sampling.prompt_logprobs is not None:
        out.prompt_logprobs = seq.prompt_logprobs
