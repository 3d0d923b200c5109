"""OpenAI-compatible request and response models (`/v1/completions`, `/v1/chat/completions`).

Requests are validated strictly from the JSON text (no "1" -> 1 coercion, no NaN/Infinity).
No field is ever silently ignored: an unknown one is a 400 naming it ("Unrecognized request
argument supplied", OpenAI's words), and the only fields accepted without effect are those
OpenAI itself documents as advisory (ADVISORY_FIELDS: `user`, `metadata`, `store`,
`service_tier`, `prompt_cache_key`, `safety_identifier`, `parallel_tool_calls` without tools,
`stream_options.include_obfuscation`). Fields we know but cannot serve
(n > 1, logprobs, echo, tools, ...) are refused with a 400 naming the field, never
silently ignored. Checks that need the tokenizer or the context length live in `prepare.py`.
`top_k`, `repetition_penalty`, `min_tokens`, `stop_token_ids` and `ignore_eos` are
vLLM-style extensions.
"""

from __future__ import annotations

import json
from typing import Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from common.wire.logprobs import MAX_TOP_LOGPROBS
from common.wire.sampling_params import MAX_CHOICES, StructuredOutput
from proxy.http.errors import ApiError, invalid_request

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 256  # prompts in one completions request (a choice each)
_UNION_TAG_CHARS = frozenset("[]()-")
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


# Accepted and without effect here, as OpenAI documents them (the README lists them too).
ADVISORY_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "parallel_tool_calls",
    "include_obfuscation",
)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", frozen=True)


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool = True  # advisory: no obfuscation padding is sent


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class GenerationParams(_Request):
    """Fields shared by both endpoints."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)  # None: up to the end of the context
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0: disabled
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Advisory (ADVISORY_FIELDS): accepted, typed, and without effect.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's constraints (at most one): a JSON schema, a regex, one of these strings, an EBNF
    # grammar (xgrammar's dialect).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    # Choices per prompt: prefilled (and its KV moved) once, forked where it decodes.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)  # vLLM's extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension
    # OpenAI: token id (as a JSON object key) -> bias in [-100, 100], added to its logit.
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for {key}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are supported")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """How many most likely tokens to report beside each sampled one (None: no logprobs)."""
        return None

    @property
    def structured_output(self) -> StructuredOutput | None:
        """The constraint on the output, if the request sets one."""
        return self._guided()

    @property
    def constraint_param(self) -> str | None:
        """The field the output constraint comes from (an error about it names this)."""
        return next((n for n in GUIDED_FIELDS if getattr(self, n) is not None), None)

    def _guided(self) -> StructuredOutput | None:
        given = [
            (name, value)
            for name, value in (
                ("guided_json", self.guided_json),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
                ("guided_grammar", self.guided_grammar),
            )
            if value is not None
        ]
        if not given:
            return None
        if len(given) > 1:
            raise ApiError(
                400, f"at most one constraint: got {', '.join(n for n, _ in given)}",
                param=given[1][0],
            )  # fmt: skip
        name, value = given[0]
        if name == "guided_json":
            spec = value if isinstance(value, str) else json.dumps(value)
            return StructuredOutput(kind="json", spec=spec, strict=False)
        if name == "guided_choice":
            return StructuredOutput(kind="choice", spec=json.dumps(value))
        kind: Literal["regex", "grammar"] = "regex" if name == "guided_regex" else "grammar"
        return StructuredOutput(kind=kind, spec=str(value))

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), b) for k, b in (self.logit_bias or {}).items())


class CompletionRequest(GenerationParams):
    """POST /v1/completions. `prompt`: text, [text], token ids, or [token ids]."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompts(cls, v: Any) -> Any:
        batch = isinstance(v, list) and v and isinstance(v[0], str | list)
        prompts = v if batch else [v]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request are supported")
        if any(len(p) == 0 for p in prompts) or len(v) == 0:
            raise ValueError("the prompt is empty")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: one choice each (text or token ids)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return cast("list[str | list[int]]", list(p))
        return [cast("str | list[int]", p)]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(
        cls, v: list[ToolCall] | None, info: ValidationInfo
    ) -> list[ToolCall] | None:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _id_is_the_tools(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "tool":
            raise ValueError("only a tool message has a tool_call_id")
        return v

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines; an
        assistant's tool calls and a tool message's call id as transformers passes them."""
        if isinstance(self.content, list):
            text = "\n".join(p.text for p in self.content)
        else:
            text = self.content or ""
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionSpec(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationParams):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # "required" allows several calls either way
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, v: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        tools = info.data.get("tools")
        if tools is None:
            if v not in (None, "none"):
                raise ValueError("tool_choice needs tools")
            return v
        if isinstance(v, NamedToolChoice) and v.function.name not in {
            t.function.name for t in tools
        }:
            raise ValueError(f"names {v.function.name!r}, which is not one of the tools")
        return v

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kind = v.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError("type must be 'text', 'json_object' or 'json_schema'")
        extra = set(v) - {"type", "json_schema"}
        if extra or (kind != "json_schema" and "json_schema" in v):
            raise ValueError(f"unexpected fields {sorted(extra) or ['json_schema']}")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("json_schema must be an object whose 'schema' is an object")
            unknown = set(spec) - {"name", "description", "schema", "strict"}
            if unknown:
                raise ValueError(f"json_schema: unexpected fields {sorted(unknown)}")
            if not isinstance(spec.get("name", ""), str):
                raise ValueError("json_schema.name must be a string")
            if not isinstance(spec.get("strict", False), bool | None):
                raise ValueError("json_schema.strict must be a boolean")
        return v

    @property
    def tool_mode(self) -> str | None:
        """How the output is a tool call: "required" (one or more, any of the tools), a
        function's name (tool_choice names it), or None (text; "auto" is the preparer's)."""
        choice = self.tool_choice
        if self.tools is None or choice in (None, "none"):
            return None if self.tools is None or choice == "none" else "auto"
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return choice

    def tool_schema(self) -> StructuredOutput:
        """The constraint that makes the output the tool call(s) (tool_mode not None):
        a named function's arguments, or for "required" a JSON array of
        {"name", "parameters"} objects, one of the tools each (vLLM's shape)."""
        assert self.tools is not None
        specs = {t.function.name: t.function for t in self.tools}
        none: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
        mode = self.tool_mode
        if mode != "required":
            assert mode is not None
            fn = specs[mode]
            schema = fn.parameters or none
            return StructuredOutput(kind="json", spec=json.dumps(schema), strict=bool(fn.strict))
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [name]},
                    "parameters": fn.parameters or none,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, fn in specs.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if self.parallel_tool_calls is False:
            array["maxItems"] = 1
        return StructuredOutput(kind="json", spec=json.dumps(array), strict=False)

    @property
    def constraint_param(self) -> str | None:
        if self.tool_mode not in (None, "auto"):
            return "tools"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format"
        return super().constraint_param

    @property
    def structured_output(self) -> StructuredOutput | None:
        if self.tool_mode not in (None, "auto"):
            if self.response_format not in (None, {"type": "text"}) or self._guided():
                raise ApiError(
                    400, "tool calls and response_format/guided_* exclude each other",
                    param="tool_choice",
                )  # fmt: skip
            return self.tool_schema()
        fmt = self.response_format
        if fmt is not None and fmt["type"] != "text":
            if self._guided() is not None:
                raise ApiError(
                    400, "response_format and a guided_* constraint exclude each other",
                    param="response_format",
                )  # fmt: skip
            if fmt["type"] == "json_object":
                return StructuredOutput(kind="json_object")
            spec = fmt["json_schema"]
            schema = spec.get("schema") or {"type": "object"}
            return StructuredOutput(
                kind="json", spec=json.dumps(schema), strict=bool(spec.get("strict"))
            )
        return self._guided()

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_request(model: type[GenerationParams], text: str) -> Any:
    """Validate the JSON ``text`` as ``model``; raise a 400 ApiError naming the first bad
    field."""
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise _to_api_error(e) from None


def _to_api_error(e: ValidationError) -> ApiError:
    errors = e.errors(include_url=False)
    # With union-typed fields pydantic reports one error per member; the deepest one is the
    # most specific (``messages[0].content[0].type`` rather than "should be a string").
    first = max(errors, key=lambda err: len(err["loc"]))
    if first["type"] == "json_invalid":
        return invalid_request(f"the body is not valid JSON: {first['msg']}", code="invalid_json")
    path = _param_path(first["loc"])
    if first["type"] == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {path}", param=path)
    msg = str(first["msg"]).removeprefix("Value error, ")
    if not path:
        return invalid_request(f"invalid request body: {msg}")
    if first["type"] == "missing":
        return invalid_request(f"missing required parameter '{path}'", param=path)
    return invalid_request(f"invalid value for '{path}': {msg}", param=path)


def _param_path(loc: tuple[int | str, ...]) -> str:
    """``('messages', 0, 'list[TextPart]', 1, 'text')`` -> ``messages[0][1].text``, dropping
    pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() in _UNION_TAGS or _UNION_TAG_CHARS & set(part):
            continue
        else:
            out += f".{part}" if out else part
    return out


# -- responses -----------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(_Response):
    """Legacy completions: per token its text, logprob, most likely alternatives (text ->
    logprob, the sampled token included) and offset in the choice's text."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    """A completion, or (with `usage` None unless it is the usage chunk) a stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseFunctionCall(_Response):
    name: str
    arguments: str


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(_Response):
    """Serialized without `tool_calls` when it made none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class _Sparse(_Response):
    """A stream delta: serialized without its unset (None) fields."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_Sparse):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    """A streamed tool call: the first delta of a call has its id, type and name, later
    ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_Sparse):
    """A chat stream delta; serialized without its unset (None) fields."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
