"""`SamplingParams.n` > 1: the engine that decodes a request forks its sequence into n
choices, once the prompt's KV is in its blocks (colocated: at choice 0's first token; decode
role: at admission, the KV having come once).

Choice j > 0 (`<request id>#<j>`) shares the full blocks before the prompt's last position
by reference count, gets its own copy of the block holding that position, and resumes one
token before the prompt's end: its next step computes that position again, into its copy,
and samples its own first token with its own parameters (`SamplingParams.for_choice`, a seed
derived from the request's). So choice j is the draw its parameters make alone, whatever the
batch, and freeing any choice releases only its references.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.engine.block_allocator import BlockAllocator
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence
from common.wire.sampling_params import SamplingParams


def fork_choices(
    parent: Sequence,
    new_seq: Callable[[str, list[int], SamplingParams], Sequence],
    allocator: BlockAllocator,
    scheduler: Scheduler,
    kv_cache: torch.Tensor,
    max_num_seqs: int,
) -> list[str]:
    """Make choices 1..n-1 of `parent`, which has its first token and its prompt's KV; their
    ids. `new_seq(id, prompt, sampling)` makes (and registers) a choice's sequence. A fork
    that finds the batch full (`max_num_seqs`) or no free block waits, and prefills its
    prompt itself (from the prefix cache) when it can."""
    parent.forked = True
    bs = scheduler.block_size
    n_prompt = parent.num_prompt_tokens
    last = (n_prompt - 1) // bs  # the block holding the prompt's last position
    prompt = parent.token_ids[:n_prompt]
    ids = []
    for j in range(1, parent.sampling.n):
        fork = new_seq(f"{parent.request_id}#{j}", prompt, parent.sampling.for_choice(j))
        fork.choice, fork.parent_id, fork.forked = j, parent.request_id, True
        fork.arrival_time, fork.times_reported = parent.arrival_time, True
        ids.append(fork.request_id)
        full = len(scheduler.running) >= max_num_seqs
        if full or not allocator.can_allocate(1 + scheduler.watermark):
            scheduler.add(fork)
            continue
        shared = parent.block_table[:last]
        allocator.share(shared)
        (copy,) = allocator.allocate(1)
        kv_cache[copy].copy_(kv_cache[parent.block_table[last]])
        fork.block_table = [*shared, copy]
        fork.num_computed_tokens = n_prompt - 1
        fork.block_hashes = parent.block_hashes[:last]
        fork.num_registered = min(parent.num_registered, last)
        fork.scheduled_time = time.time()
        scheduler.add_running(fork)
    return ids


class ChoiceBook:
    """The engine's books of choices: each forked request's choice ids (choices 1..n-1), and
    the choices aborted before their request forked (a decode node still receiving the KV),
    which end at the fork."""

    def __init__(self) -> None:
        self.forks: dict[str, list[str]] = {}  # request id -> its choices' ids
        self._early_ends: dict[str, set[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.forks)

    def add(self, request_id: str, choice_ids: list[str]) -> None:
        self.forks[request_id] = choice_ids

    def pop(self, request_id: str) -> list[str]:
        """Forget the request's choices; their ids (choice j at index j - 1)."""
        return self.forks.pop(request_id, [])

    def target(self, request_id: str, choice: int, pending: bool) -> str | None:
        """The id of choice `choice` of a forked request (choice 0: the request's own), or
        None: no such choice, or not forked yet. A request not forked yet but `pending`
        (it will fork) notes the choice, to end it at the fork (`take_early_ends`)."""
        forks = self.forks.get(request_id)
        if forks is None:
            if pending:
                self._early_ends.setdefault(request_id, set()).add(choice)
            return None
        if choice > len(forks):
            return None
        return request_id if choice == 0 else forks[choice - 1]

    def take_early_ends(self, request_id: str) -> list[int]:
        """The choices aborted before the request forked, in order (forgotten)."""
        return sorted(self._early_ends.pop(request_id, ()))

    def forget_ended(self, alive: Callable[[str], bool]) -> None:
        """Drop the requests whose every choice (and the request itself) ended."""
        for parent, ids in list(self.forks.items()):
            if not alive(parent) and not any(alive(f) for f in ids):
                del self.forks[parent]

    def forget(self, request_id: str) -> None:
        self._early_ends.pop(request_id, None)
