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

from proxy.http.errors import ApiError
from proxy.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
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
        if not delta.text and delta.finish_reason is None:
            return None
        if delta.finish_reason is None:
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


class ApiFormat(Protocol):
    """Formats one request's output as its endpoint does."""

    def stream_start(self) -> list[bytes]: ...

    def stream_delta(self, delta: TextDelta) -> bytes | None: ...

    def stream_usage(self, usage: Usage) -> bytes: ...

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]: ...


class CompletionFormat:
    """`/v1/completions` bodies (`text_completion` objects)."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self._text = TextEvents(self._delta_chunk)

    def stream_start(self) -> list[bytes]:
        return []

    def stream_delta(self, delta: TextDelta) -> bytes | None:
        return self._text.stream_delta(delta)

    def _delta_chunk(self, delta: TextDelta) -> bytes:
        choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
        return self._chunk([choice], None)

    def stream_usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return self._body([choice], usage).model_dump(mode="json")

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

    def stream_start(self) -> list[bytes]:
        first = ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))
        return [self._chunk([first], None)]

    def stream_delta(self, delta: TextDelta) -> bytes | None:
        return self._text.stream_delta(delta)

    def _delta_chunk(self, delta: TextDelta) -> bytes:
        content = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
        choice = ChatStreamChoice(delta=content, finish_reason=delta.finish_reason)
        return self._chunk([choice], None)

    def stream_usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        m = self.meta
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        body = ChatCompletionResponse(
            id=m.request_id, created=m.created, model=m.model, choices=[choice], usage=usage
        )
        return body.model_dump(mode="json")

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None) -> bytes:
        m = self.meta
        chunk = ChatCompletionChunk(
            id=m.request_id, created=m.created, model=m.model, choices=choices, usage=usage
        )
        exclude = None if m.include_usage else {"usage"}
        return sse_event(chunk.model_dump_json(exclude=exclude))
