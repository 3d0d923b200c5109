"""Incremental detokenization: turn a stream of token ids into a stream of finished text.

Technique (the prefix-offset / read-offset scheme of vLLM and HF ``DecodeStream``): text is
decoded from a short window of recent tokens, never from the whole sequence.

    ids:  [ ... dropped ... | prefix_offset ... read_offset | ... pending ... ]
                              (already emitted, context)      (not yet emitted)

``prefix_text = decode(ids[prefix:read])`` and ``full = decode(ids[prefix:])``.  Decoding
from ``prefix`` rather than ``read`` gives the decoder its left context (a SentencePiece
leading-space strip, or a character split across tokens, only affects the window's start,
whose text was already emitted).  When ``full`` grew past ``prefix_text`` and is *settled*,
the suffix ``full[len(prefix_text):]`` is emitted and the window slides: ``prefix = read``,
``read = len(ids)``.  Settled means:

- it does not end in U+FFFD: the last token may end inside a multi-byte UTF-8 character that
  the next token completes;
- the last token the decoder sees is not a byte-fallback ``<0xNN>`` token: a run of those
  decodes as one unit and turns entirely into U+FFFD if it ends up invalid, rewriting text
  already seen (skipped special tokens do not end a run).

Invariant: ``"".join(push(...) for each chunk) + flush() == tokenizer.decode(all_ids)`` (with
the same ``skip_special_tokens``), and text returned by ``push`` never ends in an incomplete
character.  Cost per push is O(window); the window spans the tokens since the emission before
last (normally a few tokens) and grows only while text stays unsettled.  Past ``max_pending``
pending tokens, the text is cut at the last token boundary where it ends on a whole character;
past ``4 * max_pending`` with no such boundary, everything pending is emitted.  That bounds
the window to O(max_pending) tokens, and can only break the invariant for pathological
streams: a byte-fallback run longer than ``max_pending`` that ends up invalid UTF-8, or more
than ``4 * max_pending`` tokens in a row that each end inside a character.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
DEFAULT_MAX_PENDING = 16
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context for the first output


class IncrementalDetokenizer:
    """Streams the text of one sequence's generated tokens.

    ``prompt_ids``, when given, are the tokens the generated ones follow: the last few are used
    as decoding context (so a SentencePiece "▁word" first output keeps its leading space) and
    their own text is never emitted.  Without them, output text equals
    ``tokenizer.decode(generated_ids)``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        *,
        prompt_ids: Sequence[int] = (),
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._max_pending = max_pending
        self._byte_fallback = tokenizer.byte_fallback_ids
        self._invisible = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # Only the window is kept: ids[0] is the token at prefix_offset.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)  # read_offset, relative to the window
        self._checked = self._read  # boundaries up to here hold no whole-character cut
        self._prefix_text = self._decode(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; return the text they finished (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        full = self._decode(self._ids)
        if self._grew_complete(full) and not self._in_byte_run():
            return self._emit(full, len(self._ids))
        pending = len(self._ids) - self._read
        if pending > self._max_pending and (cut := self._last_complete_cut(full)) is not None:
            return self._emit(*cut)
        if pending > 4 * self._max_pending:  # garbage: no whole character in sight
            return self._emit(full, len(self._ids))
        return ""

    def flush(self) -> str:
        """Return all text not yet emitted (the stream is over)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids), len(self._ids))

    @property
    def window_size(self) -> int:
        """Tokens currently decoded per push (for tests and metrics)."""
        return len(self._ids)

    def _grew_complete(self, text: str) -> bool:
        """``text`` (a decode of the window's first tokens) adds to the prefix and does not end
        inside a character."""
        return len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT)

    def _in_byte_run(self) -> bool:
        """The last token the decoder sees is a byte-fallback token (skipped special tokens and
        unknown ids are invisible to it, so a run continues across them)."""
        if not self._byte_fallback:
            return False
        for token_id in reversed(self._ids):
            if token_id in self._byte_fallback:
                return True
            if token_id not in self._invisible and self._tokenizer.id_to_token(token_id):
                return False
        return False

    def _last_complete_cut(self, full: str) -> tuple[str, int] | None:
        """The last pending token boundary where the text ends on a whole character (even
        inside a byte-fallback run: exact unless that run turns out invalid), as (text, end).

        Boundaries already examined are not decoded again: a boundary's text depends only on
        the tokens before it, so each is decoded at most once per window.
        """
        for end in range(len(self._ids), max(self._read, self._checked), -1):
            text = full if end == len(self._ids) else self._decode(self._ids[:end])
            if self._grew_complete(text):
                return text, end
        self._checked = len(self._ids)
        return None

    def _emit(self, text: str, end: int) -> str:
        """Emit ``text`` (the decode of the window up to ``end``) past the prefix; slide the
        window: it now starts at the old read offset, and ``end`` is the new read offset."""
        new_text = text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = self._checked = end - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        return new_text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
