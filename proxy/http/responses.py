"""Response bodies and SSE chunks for both endpoints, behind one small interface.

Stream shape (OpenAI): chat starts with a role chunk; each text delta is one chunk; the delta
that finishes carries `finish_reason`; with `stream_options.include_usage` every chunk has
`"usage": null` and a last chunk with empty `choices` carries the usage; then `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from common.wire.logprobs import TokenLogprobs
from proxy.http.errors import ApiError
from proxy.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from proxy.http.text_stream import TextDelta

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def sse_error(error: ApiError) -> bytes:
    return sse_event(json.dumps(error.body()))


_MARK = "pdserveTextMark7f3a"


class TextEvents:
    """One response's stream events for text deltas, a text-only one from a template.

    `build(delta)` is the endpoint's event for a delta (its pydantic models, serialized);
    the template is `build` of a marked text split around the mark, so every text-only
    event after the first costs one `json.dumps` of the text instead of building and
    serializing the models again. Finishing deltas take `build`. The result is the same JSON
    (tests compare them)."""

    def __init__(self, build: Callable[[TextDelta], bytes]) -> None:
        self._build = build
        sample, mark = build(TextDelta(_MARK)), json.dumps(_MARK).encode()
        # No template if the id or the model name holds the mark.
        self._parts = tuple(sample.split(mark)) if sample.count(mark) == 1 else None

    @staticmethod
    def mark() -> str:
        return _MARK

    def event(self, text: str) -> bytes | None:
        """The template's event for `text`; None without a template."""
        if self._parts is None:
            return None
        return self._parts[0] + json.dumps(text, ensure_ascii=False).encode() + self._parts[1]

    def stream_delta(self, delta: TextDelta) -> bytes | None:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        if delta.finish_reason is None and delta.logprobs is None and delta.echo_logprobs is None:
            event = self.event(delta.text)
            if event is not None:
                return event
        return self._build(delta)


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached_tokens, prompt_tokens)),
    )


@dataclass(frozen=True)
class ResponseMeta:
    """What every body of one response shares."""

    request_id: str
    model: str
    created: int  # unix seconds
    include_usage: bool = False
    # A token's bytes in decoded text (Tokenizer.token_bytes), to render logprobs.
    token_bytes: Callable[[int], bytes] = lambda _: b""


class TokenText:
    """Token ids as logprobs show them: their text (invalid UTF-8 of a token that is part of
    a character becomes U+FFFD) and bytes."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes

    def text(self, token_id: int) -> str:
        return self._bytes(token_id).decode("utf-8", errors="replace")

    def byte_list(self, token_id: int) -> list[int]:
        return list(self._bytes(token_id))


class ApiFormat(Protocol):
    """Formats one request's output as its endpoint does."""

    def stream_start(self) -> list[bytes]: ...

    def stream_delta(self, delta: TextDelta) -> bytes | None: ...

    def stream_usage(self, usage: Usage) -> bytes: ...

    def response(self, whole: TextDelta, usage: Usage) -> dict[str, Any]: ...


class CompletionFormat:
    """`/v1/completions` bodies (`text_completion` objects)."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self._text = TextEvents(self._delta_chunk)
        self._tokens = TokenText(meta.token_bytes)
        self._offset = 0  # text_offset of the next token

    def stream_start(self) -> list[bytes]:
        return []

    def stream_delta(self, delta: TextDelta) -> bytes | None:
        return self._text.stream_delta(delta)

    def _delta_chunk(self, delta: TextDelta) -> bytes:
        choice = CompletionChoice(
            text=delta.text, logprobs=self._logprobs(delta), finish_reason=delta.finish_reason
        )
        return self._chunk([choice], None)

    def stream_usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def response(self, whole: TextDelta, usage: Usage) -> dict[str, Any]:
        choice = CompletionChoice(
            text=whole.text, logprobs=self._logprobs(whole), finish_reason=whole.finish_reason
        )
        return self._body([choice], usage).model_dump(mode="json")

    def _logprobs(self, delta: TextDelta) -> CompletionLogprobs | None:
        """The legacy shape; each token's text_offset counts the texts of the tokens before
        it (as vLLM does), its top_logprobs the sampled token too."""
        if delta.logprobs is None and delta.echo_logprobs is None:
            return None
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        echoed = zip(delta.echo_ids, delta.echo_logprobs or (), strict=True)
        made = zip(delta.token_ids, delta.logprobs or (), strict=True)
        for token_id, lp in [*echoed, *made]:
            text = self._tokens.text(token_id)
            out.text_offset.append(self._offset)
            self._offset += len(text)
            out.tokens.append(text)
            if lp is None:  # the prompt's first token: nothing before it to predict it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(lp.logprob)
            top = {self._tokens.text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            out.top_logprobs.append(top)
        return out

    def _body(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        m = self.meta
        return CompletionResponse(
            id=m.request_id, created=m.created, model=m.model, choices=choices, usage=usage
        )

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None) -> bytes:
        exclude = None if self.meta.include_usage else {"usage"}
        return sse_event(self._body(choices, usage).model_dump_json(exclude=exclude))


class ChatFormat:
    """`/v1/chat/completions` bodies (`chat.completion` and `chat.completion.chunk`)."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self._text = TextEvents(self._delta_chunk)
        self._tokens = TokenText(meta.token_bytes)

    def stream_start(self) -> list[bytes]:
        first = ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))
        return [self._chunk([first], None)]

    def stream_delta(self, delta: TextDelta) -> bytes | None:
        return self._text.stream_delta(delta)

    def _delta_chunk(self, delta: TextDelta) -> bytes:
        content = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
        choice = ChatStreamChoice(
            delta=content, logprobs=self._logprobs(delta), finish_reason=delta.finish_reason
        )
        return self._chunk([choice], None)

    def stream_usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def response(self, whole: TextDelta, usage: Usage) -> dict[str, Any]:
        m = self.meta
        choice = ChatChoice(
            message=AssistantMessage(content=whole.text),
            logprobs=self._logprobs(whole),
            finish_reason=whole.finish_reason,
        )
        body = ChatCompletionResponse(
            id=m.request_id, created=m.created, model=m.model, choices=[choice], usage=usage
        )
        return body.model_dump(mode="json")

    def _logprobs(self, delta: TextDelta) -> ChatLogprobs | None:
        if delta.logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=self._tokens.text(token_id),
                    logprob=lp.logprob,
                    bytes=self._tokens.byte_list(token_id),
                    top_logprobs=self._top(lp),
                )
                for token_id, lp in zip(delta.token_ids, delta.logprobs, strict=True)
            ]
        )

    def _top(self, lp: TokenLogprobs) -> list[TopLogprob]:
        return [
            TopLogprob(token=self._tokens.text(t), logprob=v, bytes=self._tokens.byte_list(t))
            for t, v in lp.top
        ]

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None) -> bytes:
        m = self.meta
        chunk = ChatCompletionChunk(
            id=m.request_id, created=m.created, model=m.model, choices=choices, usage=usage
        )
        exclude = None if m.include_usage else {"usage"}
        return sse_event(chunk.model_dump_json(exclude=exclude))
