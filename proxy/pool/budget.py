"""The pre-decode budget: how much work may be between the edge and the decode pool.

A disaggregated request is *pre-decode* from the moment the edge admits it until a decode
node takes it (its decode stream is accepted), or it ends: it is prefilling (queued on or
computed by a prefill node), or prefilled and waiting in the inter-stage queue with its KV
held on a prefill node. The edge admits a request only while the pre-decode stage has room
for it, so prefill never computes KV that the pipeline cannot carry on to decode, a prefilled
request is never refused for lack of queue room, and a request does not sit in a prefill
node's queue longer than the backlog horizon; everything else waits at the edge, where its
deadline applies.

The room (`pipeline_limits`) follows the pools:

- requests: as many as the healthy decode nodes run at once (their `max_num_seqs` summed; or
  a configured number): one refill of the decode pool waiting while it works;
- prompt tokens: as many as the decode nodes' KV caches hold;
- prompt tokens still to prefill (less what the best prefill node has cached): the prefill
  nodes' measured rates summed, times `backlog_s` (unlimited until a rate is measured).

An empty stage takes any one request, however large, and while fewer requests are prefilling
than there are prefill nodes, the stage takes another prefill whatever its size: nothing
waits for room that cannot appear, and one long prompt on one node does not leave the other
prefill nodes idle while requests wait at the edge (with a pool-wide token bound alone, a
prompt longer than the horizon held every other node idle until it was done).

The prefill horizon bounds the prefill pool's queue, so it does not hold back a prompt that
would not join that queue: under `--disagg-mode auto` (or `never`) a prompt that a decode
node would prefill itself now (`local`, the placement's own rule) fits whenever the request
and KV bounds have room. Without this, one long prompt prefilling held every short prompt
behind it at the edge, prompts `auto` would have sent to the decode node: in session 28's
goodput search at 0.9 req/s, short prompts had 3-8 s TTFTs behind 800-token ones.

`hold`/`prefilled`/`release` are keyed by request id and idempotent; each that frees room
tells the listeners (the edge admits its next waiter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proxy.pool.node_state import Role
from proxy.pool.registry import NodeRegistry


@dataclass(frozen=True)
class Limits:
    requests: int
    tokens: int | None  # None: unknown (no decode node has reported its KV size)
    prefill_tokens: int | None = None  # None: no limit (no rate measured, or none set)
    prefill_nodes: int = 1  # this many prefills are admitted whatever their size


@dataclass(frozen=True)
class Claim:
    """What one request takes from the budget."""

    tokens: int  # its prompt: KV a decode node will hold
    prefill_tokens: int  # of those, the ones a prefill node must compute
    prompt: Sequence[int] = field(default=(), compare=False, repr=False)  # to place it


class PreDecodeBudget:
    def __init__(
        self,
        limits: Callable[[], Limits],
        uncached: Callable[[Sequence[int]], int] | None = None,
        local: Callable[[Sequence[int], float, int], bool] | None = None,
    ) -> None:
        self.limits = limits
        self._uncached = uncached or len
        # Whether a prompt would be prefilled on a decode node now, having waited so many
        # seconds behind so many prompt tokens to prefill (DisaggBackend.prefills_locally).
        self.local = local
        self._held: dict[str, Claim] = {}
        self._prefilling: set[str] = set()
        self._tokens = self._prefill_tokens = 0
        self._listeners: list[Callable[[], None]] = []

    @property
    def requests(self) -> int:
        return len(self._held)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def prefill_tokens(self) -> int:
        return self._prefill_tokens

    def add_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` is called whenever room is freed."""
        self._listeners.append(listener)

    def claim(self, prompt_token_ids: Sequence[int]) -> Claim:
        """The claim of a prompt, with its prefill work estimated now (the prefix the best
        prefill node has cached is not work)."""
        n = len(prompt_token_ids)
        return Claim(n, max(1, min(n, self._uncached(prompt_token_ids))), prompt_token_ids)

    def fits(self, claim: Claim, waited_s: float = 0.0) -> bool:
        """Whether `claim` may enter now; `waited_s`: how long it has waited at the edge."""
        if not self._held:
            return True
        limits = self.limits()
        if not self._room(claim, limits):
            return False
        return (
            limits.prefill_tokens is None
            or len(self._prefilling) < max(1, limits.prefill_nodes)
            or self._prefill_tokens + claim.prefill_tokens <= limits.prefill_tokens
            or self.goes_local(claim, waited_s)
        )

    def room(self, claim: Claim) -> bool:
        """Whether the request and KV bounds have room for `claim` (the prefill horizon
        aside): a claim that fails only the horizon waits for the prefill pool alone."""
        return not self._held or self._room(claim, self.limits())

    def goes_local(self, claim: Claim, waited_s: float = 0.0, ahead_tokens: int = 0) -> bool:
        """Whether `claim`'s prompt would be prefilled on a decode node now, taking none of
        the prefill pool's room, having waited `waited_s` at the edge behind `ahead_tokens`
        prompt tokens to prefill."""
        if self.local is None or not claim.prompt:
            return False
        return self.local(claim.prompt, waited_s, ahead_tokens)

    def _room(self, claim: Claim, limits: Limits) -> bool:
        if len(self._held) >= limits.requests:
            return False
        return limits.tokens is None or self._tokens + claim.tokens <= limits.tokens

    def hold(self, request_id: str, claim: Claim) -> None:
        """Count `request_id` as pre-decode and still to prefill (replacing what it held)."""
        self._drop(request_id)
        self._held[request_id] = claim
        self._prefilling.add(request_id)
        self._tokens += claim.tokens
        self._prefill_tokens += claim.prefill_tokens

    def prefilled(self, request_id: str) -> None:
        """`request_id`'s prefill is done: it no longer counts as prefill work."""
        if request_id in self._prefilling:
            self._prefilling.discard(request_id)
            self._prefill_tokens -= self._held[request_id].prefill_tokens
            self._notify()

    def release(self, request_id: str) -> None:
        """`request_id` left the pre-decode stage (a no-op if it was not in it)."""
        if self._drop(request_id):
            self._notify()

    def _drop(self, request_id: str) -> bool:
        claim = self._held.pop(request_id, None)
        if claim is None:
            return False
        self._tokens -= claim.tokens
        if request_id in self._prefilling:
            self._prefilling.discard(request_id)
            self._prefill_tokens -= claim.prefill_tokens
        return True

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()


def pipeline_limits(
    registry: NodeRegistry, max_requests: int = 0, backlog_s: float = 0.0
) -> Callable[[], Limits]:
    """Limits from the healthy nodes' last `/state`: the decode nodes' `max_num_seqs` summed
    (or `max_requests` when > 0) and their KV caches' tokens summed; the prefill nodes'
    measured prefill rates summed times `backlog_s` (0: no prefill limit)."""

    def limits() -> Limits:
        seqs = kv_tokens = 0
        known = False
        for node in registry.healthy(Role.DECODE):
            state = node.state
            if state is None or state.capacity is None:
                continue
            cap = state.capacity
            seqs += cap.max_num_seqs
            total = state.blocks.get("total", 0)
            if total > 0:
                kv_tokens += total * cap.block_size
                known = True
        prefill_nodes = registry.healthy(Role.PREFILL)
        rates = [
            n.state.prefill_tokens_per_s if n.state is not None else None for n in prefill_nodes
        ]
        prefill = None
        if backlog_s > 0 and rates and all(r is not None and r > 0 for r in rates):
            prefill = max(1, int(backlog_s * sum(r for r in rates if r is not None)))
        requests = max_requests if max_requests > 0 else max(seqs, 1)
        return Limits(requests, kv_tokens if known else None, prefill, max(1, len(prefill_nodes)))

    return limits


def uncached_tokens(registry: NodeRegistry) -> Callable[[Sequence[int]], int]:
    """A prompt's tokens less the longest prefix a healthy prefill node has cached (as the
    proxy's KV index knows it)."""

    def uncached(prompt_token_ids: Sequence[int]) -> int:
        index = registry.index
        nodes = registry.healthy(Role.PREFILL)
        if index is None or not nodes:
            return len(prompt_token_ids)
        best = max(index.matched_tokens(n, prompt_token_ids) for n in nodes)
        return len(prompt_token_ids) - best

    return uncached
