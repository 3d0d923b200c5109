"""What this proxy sent a node that the node's last `/state` cannot show yet, for routing.

A node's state comes from a poll every `poll_interval_s`; between polls the proxy counts
what it sent there itself. Each send is a numbered ticket holding the prompt tokens the node
must compute (its prefill queue) and, for work that stays there (a decode), the KV tokens it
keeps and one sequence slot:

    send ──► counted ──┬─ a poll that began after it returns ─► in the state: forgotten here
                       └─ computed (the first token came)    ─► off the prefill queue at once

A poll's state can itself be stale for a prompt computed while the poll was in flight or
since (it may show it still queued): such tokens are credited against that state until a
poll that began after the computation returns. Without this, a node that had just computed
a prompt looked busy for up to a poll interval, and the router sent the same prompt's next
request to a node without its cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_COVERED = 100_000  # sends in a state, not yet computed (bounded: a lost answer drops)


@dataclass
class SentLoad:
    tokens: int = 0  # prompt tokens sent, not yet computed nor in a state
    kv_tokens: int = 0  # KV tokens sent for decodes, not yet in a state
    requests: int = 0  # requests sent, not yet in a state
    credit: int = 0  # prompt tokens computed that the current state may still show queued
    _sends: dict[int, tuple[int, int]] = field(default_factory=dict)  # ticket -> tokens
    _covered: dict[int, int] = field(default_factory=dict)  # in a state, to compute: tokens
    _tickets: int = 0
    _poll_mark: int | None = None  # the poll in flight: tickets before it may be in its state
    _credit_next: int = 0  # `credit` for the state the poll in flight brings

    def send(self, prefill_tokens: int, kv_tokens: int = 0) -> int:
        """Count a request sent; its ticket (for `computed`)."""
        ticket = self._tickets
        self._tickets += 1
        self._sends[ticket] = (prefill_tokens, kv_tokens)
        self.tokens += prefill_tokens
        self.kv_tokens += kv_tokens
        self.requests += 1
        return ticket

    def computed(self, ticket: int) -> None:
        """The node computed send `ticket`'s prompt (or never will): off its prefill queue,
        here and in any state that may show it. Idempotent."""
        send = self._sends.get(ticket)
        if send is not None:
            tokens = send[0]
            self._sends[ticket] = (0, send[1])
            self.tokens -= tokens
        else:
            tokens = self._covered.pop(ticket, 0)
            self.credit += tokens  # the current state was read after the send
        if self._poll_mark is not None and ticket < self._poll_mark:
            self._credit_next += tokens  # the state on its way may show it queued too

    def poll_began(self) -> int:
        """A poll of the node's state starts; its mark (for `poll_returned`)."""
        self._poll_mark, self._credit_next = self._tickets, 0
        return self._tickets

    def poll_returned(self, mark: int) -> None:
        """The poll that began at `mark` brought a new state: what was sent before it is in
        that state (queued there, unless computed since: credited)."""
        for ticket in list(self._sends):  # (in ticket order)
            if ticket >= mark:
                break
            prefill_tokens, kv_tokens = self._sends.pop(ticket)
            self.tokens -= prefill_tokens
            self.kv_tokens -= kv_tokens
            self.requests -= 1
            if prefill_tokens:
                self._covered[ticket] = prefill_tokens
        while len(self._covered) > _MAX_COVERED:
            del self._covered[next(iter(self._covered))]
        self.credit, self._credit_next, self._poll_mark = self._credit_next, 0, None

    def queued(self, reported: int) -> int:
        """The node's queued prompt tokens now: as `reported` by its state, less what was
        computed since, plus what was sent since."""
        return max(0, reported - self.credit) + self.tokens
