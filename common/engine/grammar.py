"""Structured output with xgrammar: each constrained sequence has a GrammarMatcher; before
sampling, the rows of constrained sequences get their token bitmask (disallowed tokens
-inf), and each sampled token is accepted into its matcher.

Grammars compile once per spec (xgrammar's compiler caches them) against the model's
vocabulary as raw token bytes; special tokens other than the stop tokens are never allowed.
The matcher of a request decoded on another node than the one that sampled its first token
is rebuilt there from the tokens accepted so far (`matcher_for`), so the constraint crosses
the disaggregation boundary with nothing but the token ids.

xgrammar (and torch, which it imports) load on the first constrained request only.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import StructuredOutput

if TYPE_CHECKING:  # xgrammar's classes, for annotations only
    from xgrammar import CompiledGrammar, GrammarCompiler, GrammarMatcher


class GrammarError(ValueError):
    """The structured-output spec does not compile (the request is refused)."""


class Grammars:
    """The engine's grammar compiler and matchers, for one model's vocabulary."""

    def __init__(
        self, tokenizer: Callable[[], Tokenizer], vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self._tokenizer = tokenizer  # loaded with the compiler, on the first constraint
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # compile() may run on a node's loop and the engine

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec`; GrammarError if it cannot compile."""
        compiler = self._get_compiler()
        try:
            # JSON without free whitespace (", " and ": " between items): free whitespace
            # lets a small model loop on blanks until max_tokens, as vLLM's
            # disable-any-whitespace option notes.
            if spec.kind == "json_object":  # OpenAI's: an object, not any JSON value
                return compiler.compile_json_schema(
                    '{"type": "object"}', strict_mode=False, any_whitespace=False
                )
            if spec.kind == "json":
                return compiler.compile_json_schema(
                    spec.spec, strict_mode=spec.strict, any_whitespace=False
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_regex(_choice_regex(spec.spec))
            return compiler.compile_grammar(spec.spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            detail = _first_line(e)
            raise GrammarError(f"the {spec.kind} constraint does not compile: {detail}") from None

    def matcher_for(self, spec: StructuredOutput, accepted: Sequence[int]) -> GrammarMatcher:
        """A matcher for `spec` that has accepted `accepted` (the output so far); GrammarError
        if those tokens do not fit the grammar."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(spec))
        for token in accepted:
            if not matcher.accept_token(token):
                raise GrammarError(f"token {token} of the output so far breaks the constraint")
        return matcher

    def _get_compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self._tokenizer()
                stops = set(self.stop_token_ids)
                special = tok.special_token_ids
                vocab: list[Any] = [
                    b"" if i in special and i not in stops else tok.token_bytes(i)
                    for i in range(self.vocab_size)
                ]
                info = xgr.TokenizerInfo(
                    vocab,
                    xgr.VocabType.RAW,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler


def apply_grammar(logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
    """Set -inf, in place, where row rows[i] of `logits` ([N, vocab]) may not go next
    according to matchers[i] (a terminated matcher allows only the stop tokens)."""
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, i)
    if rows == list(range(logits.shape[0])):  # every row: in place, no gather and scatter
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab)
        return
    part = logits[rows]
    xgr.apply_token_bitmask_inplace(part, bitmask.to(part.device), vocab_size=vocab)
    logits[rows] = part


_REGEX_SPECIAL = frozenset("\\.^$*+?()[]{}|/-")


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def _choice_regex(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"choice: not a JSON list of strings ({e})") from None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise GrammarError("choice: a non-empty JSON list of strings is required")
    return "|".join(f"({_escape(c)})" for c in choices)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[0-9:]+\] \S+: ", "", text)[:300]
