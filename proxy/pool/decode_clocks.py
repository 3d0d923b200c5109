"""The streams this proxy relays from each decode node, timed against the TPOT objective:
how much longer the slowest-placed of them may wait before it misses it (`slack_s`). `auto`
(placement.py) prefills a prompt on a decode node only if the stall fits every stream
there.

A stream's TPOT is (its last token's time - its first's) / (tokens - 1), so over its
`max_tokens` = N tokens it may take (N - 1) x objective from its first token to its last.
Of that it has used the time since its first token, and its k tokens so far leave N - k
steps, each of about the node's step time now (the mean gap between the tokens that the
proxy relayed from the node lately, stalls included: a TPOT is a mean, and the stalls that
raised the recent gaps recur). What is left is its slack:

    slack = (N - 1) x objective - (now - first token) - (N - k) x step time

A local prefill of the prompt holds every stream on the node for one longer step (the
prompt's prefill time there), which a stream whose slack is smaller would miss its
objective by. The slack spent by each stall shows in the next decision: the elapsed time
has grown and the step time with it. (Session 39 first took the median gap: it is the
typical decode step, below the mean that TPOT is, and `auto` never found a stream short of
slack while the runs' TPOT p50 was 95 ms against a 100 ms objective.) A stream may end
sooner (a stop token); then its TPOT is over fewer tokens, and the same stall weighs more:
the estimate is the best case.

Each proxy knows only the streams it relays; with several proxies in front of one decode
pool, each judges the node by its own share (the streams of the others are unseen).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

GAPS = 256  # the recent gaps between tokens a node's step time is the mean of


@dataclass
class Clock:
    """One stream on a decode node: when its first token came, how many it has had."""

    first_s: float  # time.monotonic()
    tokens: int
    max_tokens: int
    last_s: float = 0.0  # the newest chunk's time

    def slack_s(self, objective_s: float, step_s: float, now: float) -> float:
        n = self.max_tokens
        return (n - 1) * objective_s - (now - self.first_s) - max(0, n - self.tokens) * step_s


@dataclass
class _NodeClocks:
    streams: dict[str, Clock] = field(default_factory=dict)
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAPS))
    total: float = 0.0  # of gaps

    def add(self, gap: float, n: int) -> None:
        for _ in range(min(n, GAPS)):
            if len(self.gaps) == GAPS:
                self.total -= self.gaps[0]
            self.gaps.append(gap)
            self.total += gap


class DecodeClocks:
    def __init__(self) -> None:
        self._nodes: dict[str, _NodeClocks] = {}

    def start(self, url: str, key: str, max_tokens: int, first_s: float, tokens: int = 1) -> Clock:
        """Time stream `key` on decode node `url`: its first token came at `first_s` and it
        has had `tokens` so far (of `max_tokens`). Pair with `stop`."""
        clock = Clock(first_s, tokens, max_tokens, first_s)
        self._nodes.setdefault(url, _NodeClocks()).streams[key] = clock
        return clock

    def tokens(self, url: str, clock: Clock, n: int, now: float | None = None) -> None:
        """`n` more tokens of `clock`'s stream came (one chunk): one gap per token."""
        now = time.monotonic() if now is None else now
        node = self._nodes.get(url)
        if node is not None and n > 0:
            node.add((now - clock.last_s) / n, n)
        clock.tokens += n
        clock.last_s = now

    def stop(self, url: str, key: str) -> None:
        node = self._nodes.get(url)
        if node is None:
            return
        node.streams.pop(key, None)
        if not node.streams:
            del self._nodes[url]  # (its step time goes too: the next streams measure anew)

    def step_s(self, url: str) -> float | None:
        """The node's step time now, as its streams' recent gaps show (None: none yet)."""
        node = self._nodes.get(url)
        return node.total / len(node.gaps) if node is not None and node.gaps else None

    def slack_s(self, url: str, objective_s: float, now: float | None = None) -> float | None:
        """The least slack of the node's streams against the TPOT objective (None: no stream
        with more than one token to come, or no step time measured yet)."""
        node = self._nodes.get(url)
        step = self.step_s(url)
        if node is None or step is None:
            return None
        now = time.monotonic() if now is None else now
        slacks = [
            c.slack_s(objective_s, step, now) for c in node.streams.values() if c.max_tokens > 1
        ]
        return min(slacks) if slacks else None

    def streams(self, url: str) -> int:
        node = self._nodes.get(url)
        return len(node.streams) if node is not None else 0
