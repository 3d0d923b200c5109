"""From one request's token chunks to text deltas: detokenization, stop tokens, stop strings.

    backend chunks ─> hide a finishing stop token ─> IncrementalDetokenizer ─> stop strings ─> text

Stop strings are matched on the output text only (never the prompt). Text that could be the
start of a stop string is held back until it is ruled out, so no part of a stop string ever
reaches the client:

    emitted | held (longest suffix that is a proper prefix of some stop string) | (next text)

On a match the text is cut before the earliest occurrence and the stream finishes with
"stop"; the caller then closes the backend stream, which cancels the generation. If the
stream ends without a match, the held text is flushed. While the request has fewer than
`min_tokens` tokens (counted per chunk), stop strings are not looked for (as in vLLM: the
engine masks EOS and stop ids until then too).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from common.wire.logprobs import TokenLogprobs
from proxy.http.backend import BackendError, TokenChunk


@dataclass(frozen=True)
class TextDelta:
    text: str
    finish_reason: str | None = None  # set on the delta that ends the stream
    # With logprobs: the rendered tokens of the chunk(s) behind this delta and theirs (the
    # text of a token may come in a later delta, held back by the detokenizer or a stop
    # string's possible start; a token cut by a stop string still counts).
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # The first delta of an echo: the prompt's tokens and, with logprobs, theirs (the first
    # prompt token has none).
    echo_ids: tuple[int, ...] = ()
    echo_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    def after(self, earlier: TextDelta) -> TextDelta:
        """This delta with the tokens (and echo) of an `earlier` one in front (its text is
        the caller's)."""
        if earlier.logprobs is None and not earlier.echo_ids:
            return self
        logprobs = None
        if earlier.logprobs is not None or self.logprobs is not None:
            logprobs = (earlier.logprobs or ()) + (self.logprobs or ())
        return TextDelta(
            self.text,
            self.finish_reason,
            earlier.token_ids + self.token_ids,
            logprobs,
            earlier.echo_ids or self.echo_ids,
            earlier.echo_logprobs or self.echo_logprobs,
        )


class StopMatcher:
    """Finds stop strings in a text stream, holding back possible partial matches."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in stops), default=0)
        self._held = ""

    @property
    def held(self) -> str:
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit, whether a stop string matched)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        # `held` contains no whole stop string and is the longest suffix that could start
        # one, so the earliest match in `buf` is the earliest in the whole output.
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held text: the stream ended without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, buf: str) -> int:
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


class TextStream:
    """Renders one request's `TokenChunk`s as `TextDelta`s and counts its tokens.

    ``stop_token_ids``: ids that end the generation (EOS unless ignored, plus the request's
    stop ids). The one that ends a "stop" chunk is counted but not rendered.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        min_tokens: int = 0,
        echo: str | None = None,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_token_ids)
        self._min_tokens = min_tokens
        self._echo = echo  # returned before the first output, then None
        self._prompt_ids = tuple(prompt_token_ids)
        self._stops = StopMatcher(stop)
        self._stop_ids = frozenset(stop_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt, as the first chunk reports it
        self._first = True
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, chunk: TokenChunk) -> TextDelta:
        """The text `chunk` completes. A delta with a finish reason is the last one."""
        if self.finished:
            raise RuntimeError("TextStream: chunk after the stream finished")
        if self._first and chunk.num_cached_tokens is not None:
            self.cached_tokens = chunk.num_cached_tokens  # (a migration's re-prefill: not it)
        first, self._first = self._first, False
        self.completion_tokens += len(chunk.token_ids)
        visible = self._visible_ids(chunk)
        text = self._detok.push(visible)
        if chunk.finish_reason is not None:
            text += self._detok.flush()
        if self.completion_tokens < self._min_tokens:
            matched = False
        else:
            text, matched = self._stops.push(text)
        lps = None if chunk.logprobs is None else tuple(chunk.logprobs[: len(visible)])
        ids = tuple(visible) if lps is not None else ()
        if matched:
            delta = self._finish(text, "stop", ids, lps)
        elif chunk.finish_reason is not None:
            delta = self._finish(text + self._stops.flush(), chunk.finish_reason, ids, lps)
        else:
            delta = TextDelta(text, None, ids, lps)
        if first and self._echo is not None:
            delta = self._echoed(delta, chunk)
        return delta

    def _echoed(self, delta: TextDelta, chunk: TokenChunk) -> TextDelta:
        """The first delta with the prompt (its text, tokens and their logprobs) in front."""
        echo, self._echo = self._echo or "", None
        echo_lps = None
        if chunk.prompt_logprobs is not None:
            if len(chunk.prompt_logprobs) != len(self._prompt_ids) - 1:
                raise BackendError.failed("the node's prompt logprobs do not cover the prompt")
            echo_lps = (None, *chunk.prompt_logprobs)
        return TextDelta(
            echo + delta.text,
            delta.finish_reason,
            delta.token_ids,
            delta.logprobs,
            self._prompt_ids,
            echo_lps,
        )

    def _visible_ids(self, chunk: TokenChunk) -> list[int]:
        ids = chunk.token_ids
        if chunk.finish_reason == "stop" and ids and ids[-1] in self._stop_ids:
            return ids[:-1]
        return ids

    def _finish(
        self,
        text: str,
        reason: str,
        ids: tuple[int, ...],
        lps: tuple[TokenLogprobs, ...] | None,
    ) -> TextDelta:
        self.finish_reason = reason
        return TextDelta(text, reason, ids, lps)
