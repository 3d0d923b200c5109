"""Response bodies and SSE chunks for both endpoints, behind one small interface.

Stream shape (OpenAI): chat starts with a role chunk; each text delta is one chunk; the delta
that finishes carries `finish_reason`; with `stream_options.include_usage` every chunk has
`"usage": null` and a last chunk with empty `choices` carries the usage; then `[DONE]`.
"""

from __future__ import annotations

import json
import uuid
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
    FunctionDelta,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseToolCall,
    ToolCallDelta,
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
    # Chat: the output is tool calls, "required" (a JSON array of {"name", "parameters"})
    # or a function's name (the output is its arguments); None: text.
    tool_call: str | None = None


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
    """Formats one choice of a request's output as its endpoint does."""

    index: int

    def stream_start(self) -> list[bytes]: ...

    def stream_delta(self, delta: TextDelta) -> bytes | None: ...

    def stream_usage(self, usage: Usage) -> bytes: ...

    def response(self, whole: TextDelta, usage: Usage) -> dict[str, Any]: ...


class CompletionFormat:
    """`/v1/completions` bodies (`text_completion` objects)."""

    def __init__(self, meta: ResponseMeta, index: int = 0) -> None:
        self.meta = meta
        self.index = index  # the choice this format renders
        self._text = TextEvents(self._delta_chunk)
        self._tokens = TokenText(meta.token_bytes)
        self._offset = 0  # text_offset of the next token

    def stream_start(self) -> list[bytes]:
        return []

    def stream_delta(self, delta: TextDelta) -> bytes | None:
        return self._text.stream_delta(delta)

    def _delta_chunk(self, delta: TextDelta) -> bytes:
        choice = CompletionChoice(
            index=self.index,
            text=delta.text,
            logprobs=self._logprobs(delta),
            finish_reason=delta.finish_reason,
        )
        return self._chunk([choice], None)

    def stream_usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def response(self, whole: TextDelta, usage: Usage) -> dict[str, Any]:
        choice = CompletionChoice(
            index=self.index,
            text=whole.text,
            logprobs=self._logprobs(whole),
            finish_reason=whole.finish_reason,
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

    def __init__(self, meta: ResponseMeta, index: int = 0) -> None:
        self.meta = meta
        self.index = index  # the choice this format renders
        self._text = TextEvents(self._delta_chunk)
        self._tokens = TokenText(meta.token_bytes)
        self._calls = ToolCalls(meta.tool_call) if meta.tool_call is not None else None

    def stream_start(self) -> list[bytes]:
        first = ChatStreamChoice(index=self.index, delta=DeltaMessage(role="assistant", content=""))
        return [self._chunk([first], None)]

    def stream_delta(self, delta: TextDelta) -> bytes | None:
        if self._calls is not None:
            return self._tool_delta(delta, self._calls)
        return self._text.stream_delta(delta)

    def _tool_delta(self, delta: TextDelta, calls: ToolCalls) -> bytes | None:
        """A named call streams its arguments as they come; "required" calls go out whole
        once the output is complete (their JSON array has to be parsed first)."""
        message = calls.stream(delta.text, delta.finish_reason)
        if message is None and delta.finish_reason is None:
            return None
        reason = calls.finish_reason(delta.finish_reason)
        choice = ChatStreamChoice(
            index=self.index,
            delta=message or DeltaMessage(),
            logprobs=self._logprobs(delta),
            finish_reason=reason,
        )
        return self._chunk([choice], None)

    def _delta_chunk(self, delta: TextDelta) -> bytes:
        content = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
        choice = ChatStreamChoice(
            index=self.index,
            delta=content,
            logprobs=self._logprobs(delta),
            finish_reason=delta.finish_reason,
        )
        return self._chunk([choice], None)

    def stream_usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)

    def response(self, whole: TextDelta, usage: Usage) -> dict[str, Any]:
        m = self.meta
        message, reason = AssistantMessage(content=whole.text), whole.finish_reason
        if self._calls is not None:
            message = self._calls.message(whole.text, reason)
            reason = self._calls.finish_reason(reason)
        choice = ChatChoice(
            index=self.index, message=message, logprobs=self._logprobs(whole), finish_reason=reason
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


class ToolCalls:
    """The model's output read as tool calls (`ResponseMeta.tool_call`). The output was
    constrained to the tools' schemas (`ChatCompletionRequest.tool_schema`); one cut short
    by max_tokens stays text, with finish_reason "length"."""

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "required" or the named function
        self._buffer = ""  # "required": the output so far
        self._started = False  # named: the call's first delta went out
        self._ids: list[str] = []

    def _id(self, i: int) -> str:
        while len(self._ids) <= i:
            self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self._ids[i]

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments) of each call in a complete output; None if it is not one."""
        if self.mode != "required":
            return [(self.mode, text)]
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(parsed, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in parsed
        ):
            return None
        return [(c["name"], json.dumps(c.get("parameters", {}))) for c in parsed]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" for calls the model chose, "stop" for a named one."""
        if reason == "stop" and self.mode == "required":
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> AssistantMessage:
        # A named call is its arguments, cut short or not (OpenAI's "length" case);
        # "required" calls are read from a complete JSON array only.
        calls = self.calls(text) if reason == "stop" or self.mode != "required" else None
        if calls is None:
            return AssistantMessage(content=text)
        return AssistantMessage(
            content=None,
            tool_calls=[
                ResponseToolCall(id=self._id(i), function=ResponseFunctionCall(name=n, arguments=a))
                for i, (n, a) in enumerate(calls)
            ],
        )

    def stream(self, text: str, reason: str | None) -> DeltaMessage | None:
        """The delta for the next piece of output (None: nothing to send yet)."""
        if self.mode != "required":
            if not text and self._started:
                return None
            first, self._started = not self._started, True
            fn = FunctionDelta(name=self.mode if first else None, arguments=text)
            call = ToolCallDelta(
                index=0, id=self._id(0) if first else None, type="function" if first else None,
                function=fn,
            )  # fmt: skip
            return DeltaMessage(tool_calls=[call])
        self._buffer += text
        if reason is None:
            return None
        calls = self.calls(self._buffer) if reason == "stop" else None
        if calls is None:
            return DeltaMessage(content=self._buffer) if self._buffer else None
        return DeltaMessage(
            tool_calls=[
                ToolCallDelta(
                    index=i,
                    id=self._id(i),
                    type="function",
                    function=FunctionDelta(name=n, arguments=a),
                )  # fmt: skip
                for i, (n, a) in enumerate(calls)
            ]
        )
