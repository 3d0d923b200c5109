"""Bad input: each gets a 4xx with an OpenAI error body naming the problem, never a 5xx."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.proxy_harness import MAX_BODY_BYTES, MAX_MODEL_LEN, MODEL, ProxyHarness

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMPLETION = {"prompt": "hi", "max_tokens": 2}
JSON = {"Content-Type": "application/json"}


async def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any], Any]:
    skip = () if "Content-Type" in headers else ("Content-Type",)  # no auto octet-stream
    async with (
        aiohttp.ClientSession(skip_auto_headers=skip) as s,
        s.post(url, data=data, headers=headers) as r,
    ):
        text = await r.text()
        is_json = r.content_type == "application/json"
        return r.status, r.headers.copy(), json.loads(text) if is_json else text


def post(proxy: ProxyHarness, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(_post(proxy.base_url + path, data, JSON if headers is None else headers))


def assert_error(resp: Any, status: int, param: str | None = None, code: str | None = None) -> str:
    got_status, headers, body = resp
    assert got_status == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["type"]
    assert "Traceback" not in body["error"]["message"]
    assert headers.get("X-Request-Id")
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return str(body["error"]["message"])


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 1.0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": 1}, "echo"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 3}, "min_tokens"),  # above max_tokens (2)
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": {str(10**9): 1.0}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a"] * 257}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [5, 10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS, ids=[p for _, p in BAD_FIELDS])
def test_bad_completion_fields(proxy: ProxyHarness, fields: dict[str, Any], param: str) -> None:
    assert_error(post(proxy, COMPLETIONS, {**OK_COMPLETION, **fields}), 400, param)


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_CHAT: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": "hi"}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"n": 17}, "n"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ({"tools": [_TOOL, _TOOL], "tool_choice": "required"}, "tools"),
    ({"tools": [_TOOL]}, "tool_choice"),  # "auto": this template has no tool-call format
    ({"tools": [_TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
        "messages[0].tool_call_id",
    ),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
        "response_format",
    ),
    ({"response_format": {"type": "json_object", "x": 1}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["x"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_fields(proxy: ProxyHarness, fields: dict[str, Any], param: str) -> None:
    resp = post(proxy, CHAT, {**OK_CHAT, **fields})
    assert_error(resp, 400)
    assert resp[2]["error"]["param"].startswith(param)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"best_of_n": 2}, "best_of_n"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ],
)
def test_unknown_fields_are_refused_by_name(
    proxy: ProxyHarness, path: str, fields: dict[str, Any], param: str
) -> None:
    """Never silently ignored: an unknown field is a 400 that names it."""
    body = {**(OK_CHAT if path == CHAT else OK_COMPLETION), **fields}
    message = assert_error(post(proxy, path, body), 400, param)
    assert message == f"Unrecognized request argument supplied: {param}"


def test_advisory_fields_are_accepted(proxy: ProxyHarness) -> None:
    """The short documented list of fields OpenAI itself treats as advisory."""
    advisory = {
        "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
        "prompt_cache_key": "k", "safety_identifier": "s",
    }  # fmt: skip
    status, _, body = post(proxy, COMPLETIONS, {**OK_COMPLETION, **advisory})
    assert status == 200, body
    chat = {**OK_CHAT, **advisory, "parallel_tool_calls": True, "tool_choice": "none"}
    chat |= {"response_format": {"type": "text"}, "stream": True}
    chat["stream_options"] = {"include_usage": True, "include_obfuscation": False}
    status, _, body = post(proxy, CHAT, chat)
    assert status == 200, body
    proxy.wait_idle()


def test_missing_required_field(proxy: ProxyHarness) -> None:
    assert_error(post(proxy, COMPLETIONS, {"max_tokens": 2}), 400, "prompt")
    assert_error(post(proxy, CHAT, {"max_tokens": 2}), 400, "messages")


def test_unknown_model_is_404(proxy: ProxyHarness) -> None:
    resp = post(proxy, CHAT, {**OK_CHAT, "model": "gpt-nope"})
    assert_error(resp, 404, "model", "model_not_found")
    assert_error(post(proxy, COMPLETIONS, {**OK_COMPLETION, "model": "x"}), 404)


def test_context_length(proxy: ProxyHarness) -> None:
    too_long = [5] * MAX_MODEL_LEN
    msg = assert_error(
        post(proxy, COMPLETIONS, {"prompt": too_long}), 400, "prompt", "context_length_exceeded"
    )
    assert str(MAX_MODEL_LEN) in msg
    prompt = [5] * 100
    resp = post(proxy, COMPLETIONS, {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - 99})
    msg = assert_error(resp, 400, "max_tokens", "context_length_exceeded")
    assert f"{MAX_MODEL_LEN + 1} tokens" in msg and "100 in the prompt" in msg


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b'{"prompt": "hi",', JSON, 400, "invalid_json"),
        (b"", JSON, 400, "invalid_json"),
        (b"[" * 10_000, JSON, 400, "invalid_json"),
        (b'{"prompt": NaN}', JSON, 400, None),
        (b'{"prompt": "hi", "temperature": NaN}', JSON, 400, None),
        (b'{"prompt": "\\ud800"}', JSON, 400, None),
        (b"[1, 2]", JSON, 400, None),
        (b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        (b'{"prompt": "\xff\xfe"}', JSON, 400, "invalid_utf8"),
        (b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}', JSON, 413, "request_too_large"),
    ],
    ids=[
        "truncated",
        "empty",
        "deep",
        "nan",
        "nan-temp",
        "surrogate",
        "array",
        "ctype",
        "utf8",
        "big",
    ],
)
def test_malformed_bodies(
    proxy: ProxyHarness, body: bytes, headers: dict[str, str], status: int, code: str | None
) -> None:
    assert_error(post(proxy, COMPLETIONS, body, headers), status, code=code)


def test_missing_content_type_is_json(proxy: ProxyHarness) -> None:
    status, _, body = post(proxy, COMPLETIONS, OK_COMPLETION, headers={})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


async def _chunked_big(url: str) -> tuple[int, Any]:
    async def gen():  # no Content-Length: the limit applies while reading
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b" " * 1024

    async with aiohttp.ClientSession() as s, s.post(url, data=gen(), headers=JSON) as r:
        return r.status, await r.json(content_type=None)


def test_oversized_chunked_body_is_413(proxy: ProxyHarness) -> None:
    status, body = asyncio.run(_chunked_big(proxy.base_url + COMPLETIONS))
    assert status == 413 and body["error"]["code"] == "request_too_large"


async def _request(method: str, url: str) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url) as r:
        return r.status, r.headers.copy(), await r.json(content_type=None)


def test_unknown_route_and_method(proxy: ProxyHarness) -> None:
    assert_error(asyncio.run(_request("GET", proxy.base_url + "/v1/nope")), 404)
    assert_error(asyncio.run(_request("GET", proxy.base_url + COMPLETIONS)), 405)


def test_health_and_models(proxy: ProxyHarness) -> None:
    status, _, body = asyncio.run(_request("GET", proxy.base_url + "/health"))
    assert (status, body) == (200, {"status": "ok"})
    status, _, body = asyncio.run(_request("GET", proxy.base_url + "/v1/models"))
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == MODEL and body["data"][0]["max_model_len"] == MAX_MODEL_LEN


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = ["prompt", "messages", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream"]
_FIELDS += ["stop_token_ids", "logprobs", "stream_options", "model", "max_completion_tokens"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from([COMPLETIONS, CHAT]),
    fields=st.dictionaries(st.sampled_from(_FIELDS), _json_values, max_size=4),
    max_tokens=st.sampled_from([1, 2, 0, -1, "2"]),
)
def test_fuzzed_requests_never_5xx(
    proxy: ProxyHarness, path: str, fields: dict[str, Any], max_tokens: Any
) -> None:
    body = {**fields, "max_tokens": max_tokens}
    data = json.dumps(body, allow_nan=True).encode()
    status, _, resp = asyncio.run(_post(proxy.base_url + path, data, JSON))
    assert status < 500, resp
    if status >= 400:
        assert set(resp["error"]) == {"message", "type", "param", "code"}
    proxy.wait_idle()


_BOGUS = {"type": "bogus"}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"guided_regex": "a(b"}, "guided_regex"),
        (COMPLETIONS, {"guided_json": _BOGUS}, "guided_json"),
        (CHAT, {"guided_grammar": "root ::= (("}, "guided_grammar"),
        (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": _BOGUS}}},
            "response_format",
        ),
        (
            CHAT,
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": _BOGUS}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_names_the_field_it_came_from(
    proxy: ProxyHarness, path: str, fields: dict[str, Any], param: str
) -> None:
    """The engine finds the constraint does not compile; the 400 names the client's field."""
    for n in (1, 3):  # one backend stream, split into n choices: refused before any
        body = {**(OK_CHAT if path == CHAT else OK_COMPLETION), **fields, "n": n}
        for stream in (False, True):
            message = assert_error(post(proxy, path, {**body, "stream": stream}), 400, param)
            assert "does not compile" in message
