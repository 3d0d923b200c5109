"""From a parsed OpenAI request to a `GenerationRequest`: model check, chat template,
tokenization, context-length and vocabulary checks, sampling parameters.

Everything here is a pure function of the request and the served model; errors are 4xx
`ApiError`s naming the parameter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pydantic import ValidationError

from common.text.tokenizer import ChatTemplateError, Tokenizer
from common.wire.sampling_params import SamplingParams
from proxy.http.backend import GenerationRequest
from proxy.http.errors import ApiError, invalid_request
from proxy.http.protocol import ChatCompletionRequest, CompletionRequest, GenerationParams

# Prompts longer than this (characters) are tokenized on a worker thread, off the event loop.
TOKENIZE_INLINE_MAX_CHARS = 16_384


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready for a backend, with what the HTTP layer keeps for itself."""

    generation: GenerationRequest
    stop: tuple[str, ...]  # stop strings, applied by the proxy
    stream: bool
    include_usage: bool
    echo: str | None = None  # completions `echo`: the prompt's text, returned before the output
    # A batch of prompts: the other prompts' requests, choices 1.. (this one is choice 0).
    also: tuple[PreparedRequest, ...] = ()
    tool_call: str | None = None  # chat: the output is tool calls ("required", or a name)
    constraint_param: str | None = None  # the field the output constraint came from

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.generation.prompt_token_ids)


class RequestPreparer:
    """Turns parsed requests into `PreparedRequest`s for one served model."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._vocab_size = tokenizer.vocab_size

    async def completion(self, request_id: str, req: CompletionRequest) -> PreparedRequest:
        """One prepared request per prompt; a batch's others are in `also` (their request ids
        are `request_id` + "-<choice>")."""
        self._check_model(req.model)
        preps = []
        for i, prompt in enumerate(req.prompts):
            rid = request_id if i == 0 else f"{request_id}-{i}"
            preps.append(await self._one_completion(rid, req, prompt))
        return replace(preps[0], also=tuple(preps[1:])) if len(preps) > 1 else preps[0]

    async def _one_completion(
        self, request_id: str, req: CompletionRequest, prompt: str | list[int]
    ) -> PreparedRequest:
        if isinstance(prompt, str):
            ids = await _tokenize(prompt, self.tokenizer.encode, "prompt")
        else:
            ids = [int(t) for t in prompt]  # token ids
            self._check_ids(ids, "prompt")
        prep = self._finish(request_id, req, ids, "prompt")
        if not req.echo:
            return prep
        echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        sampling = prep.generation.sampling.model_copy(update={"prompt_logprobs": req.logprobs})
        generation = replace(prep.generation, sampling=sampling)
        return replace(prep, generation=generation, echo=echo)

    async def chat(self, request_id: str, req: ChatCompletionRequest) -> PreparedRequest:
        self._check_model(req.model)
        messages = [m.template_dict() for m in req.messages]
        mode = req.tool_mode
        if mode == "auto":
            raise invalid_request(
                "tool_choice 'auto' (the default when tools are given) needs a chat template "
                "with a tool-call format to parse the model's calls from, and this model's has "
                "none: use tool_choice 'required' or name a function",
                param="tool_choice",
            )
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self.tokenizer.apply_chat_template(messages, True, tools)
        except ChatTemplateError as e:
            raise invalid_request(str(e), param="messages") from e
        ids = await _tokenize(text, self._encode_chat_text, "messages")
        prep = self._finish(request_id, req, ids, "messages")
        return replace(prep, tool_call=mode) if mode is not None else prep

    # -- checks ------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        if any(not 0 <= t < self._vocab_size for t in ids):
            raise invalid_request(f"token ids must be in [0, {self._vocab_size})", param=param)

    def _max_tokens(self, requested: int | None, num_prompt: int, prompt_param: str) -> int:
        """`requested`, or all the context the prompt leaves; 400 when it does not fit."""
        context = self.max_model_len
        if num_prompt >= context:
            raise invalid_request(
                f"This model's maximum context length is {context} tokens. However, your "
                f"{prompt_param} has {num_prompt} tokens, leaving no room for a completion. "
                f"Please reduce the length of the {prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return context - num_prompt
        if num_prompt + requested > context:
            raise invalid_request(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {num_prompt + requested} tokens ({num_prompt} in the "
                f"{prompt_param}, {requested} in the completion). Please reduce the length of "
                f"the {prompt_param} or the completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    # -- assembly ----------------------------------------------------------------------------

    def _finish(
        self, request_id: str, req: GenerationParams, ids: list[int], prompt_param: str
    ) -> PreparedRequest:
        if not ids:
            raise invalid_request(f"the {prompt_param} is empty", param=prompt_param)
        self._check_ids(req.stop_token_ids, "stop_token_ids")
        bias = req.logit_bias_pairs
        self._check_ids([t for t, _ in bias], "logit_bias")
        structured = req.structured_output
        max_tokens = self._max_tokens(req.requested_max_tokens, len(ids), prompt_param)
        if req.min_tokens > max_tokens:
            raise invalid_request(
                f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})",
                param="min_tokens",
            )
        try:
            sampling = SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                max_tokens=max_tokens,
                stop_token_ids=tuple(req.stop_token_ids),
                ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                min_tokens=req.min_tokens,
                logit_bias=bias,
                logprobs=req.num_logprobs,
                structured=structured,
                n=req.n,
            )
        except ValidationError as e:  # our bounds are tighter; this is a safety net
            raise invalid_request(f"invalid sampling parameters: {e.errors()[0]['msg']}") from e
        return PreparedRequest(
            generation=GenerationRequest(request_id, ids, sampling),
            stop=req.stop_strings,
            stream=req.stream,
            include_usage=req.include_usage,
            constraint_param=req.constraint_param if structured is not None else None,
        )

    def _encode_chat_text(self, text: str) -> list[int]:
        # The template writes BOS and other special tokens itself (see Tokenizer.encode_chat).
        return self.tokenizer.encode(text, add_special_tokens=False)


async def _tokenize(text: str, encode: Callable[[str], list[int]], param: str) -> list[int]:
    """`encode(text)`, on a worker thread when the text is long; 400 on text the tokenizer
    cannot take (e.g. lone surrogates)."""
    try:
        if len(text) <= TOKENIZE_INLINE_MAX_CHARS:
            return encode(text)
        return await asyncio.to_thread(encode, text)
    except (UnicodeError, TypeError, ValueError) as e:
        raise invalid_request(f"the {param} cannot be tokenized: {e}", param=param) from e
