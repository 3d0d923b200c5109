"""Issue 4 acceptance: the disaggregated service end to end, real processes on loopback;
issue 5's soak on the 2P2D cluster; issue 18's bursts (admission at the edge) on the 1P1D
cluster."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
import openai
import pytest

from common.text.tokenizer import Tokenizer
from common.tiny.corpus import CORPUS
from common.wire.sampling_params import SamplingParams
from tests.support import procs
from tests.support.aclient import metric, sample_sum
from tests.support.cluster import Cluster, Server, start_cluster
from tests.support.http import http_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPOLOGIES = {"1p1d": (1, 1, 0), "2p2d": (2, 2, 0), "colocated": (0, 0, 1)}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def cluster(request: pytest.FixtureRequest, tiny_model_dir: Path):
    c = start_cluster(tiny_model_dir, TOPOLOGIES[request.param])
    try:
        yield c
    finally:
        c.close()


def _client(cluster: Cluster) -> openai.OpenAI:
    assert cluster.proxy is not None
    return openai.OpenAI(base_url=f"{cluster.proxy.url}/v1", api_key="x", timeout=60, max_retries=0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_openai_client_streams_chat_and_completion_equal_to_offline(
    cluster: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    client = _client(cluster)
    model = _model(client)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    messages = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    want = offline_token_ids(tokenizer.encode_chat(messages), sp)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == tokenizer.decode(want)
    assert usage is not None and usage.completion_tokens == len(want)

    prompt = "Héllo wörld, 你好! Once upon a time"
    want = offline_token_ids(tokenizer.encode(prompt), sp)
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == tokenizer.decode(want)
    full = client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].text == text and full.choices[0].finish_reason == "length"
    cluster.wait_baseline()


def test_sampling_controls_match_offline_streamed_and_not(
    cluster: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """Issue 19: penalties, logit_bias, min_tokens and seed through the openai client, on
    both endpoints, streamed and not: the offline engine's tokens with the same parameters
    (the first token is sampled on the prefill node, the rest on the decode node)."""
    client = _client(cluster)
    model = _model(client)
    eos = tokenizer.eos_token_ids[0]
    extra = {"repetition_penalty": 1.3, "min_tokens": 12}
    sp = SamplingParams(
        temperature=0.8, seed=11, max_tokens=16, presence_penalty=0.5, frequency_penalty=0.7,
        logit_bias=((eos, 5.0), (tokenizer.encode(" the")[0], -100.0)), **extra,
    )  # fmt: skip
    common = {
        "model": model, "max_tokens": 16, "temperature": 0.8, "seed": 11,
        "presence_penalty": 0.5, "frequency_penalty": 0.7, "extra_body": extra,
        "logit_bias": {str(t): b for t, b in sp.logit_bias},
    }  # fmt: skip
    messages = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    prompt = "Once upon a time the"
    want_chat = tokenizer.decode(offline_token_ids(tokenizer.encode_chat(messages), sp))
    want_text = tokenizer.decode(offline_token_ids(tokenizer.encode(prompt), sp))
    plain = SamplingParams(temperature=0.8, seed=11, max_tokens=16)
    assert want_text != tokenizer.decode(offline_token_ids(tokenizer.encode(prompt), plain))
    for stream in (False, True):
        chat = client.chat.completions.create(messages=messages, stream=stream, **common)
        text = (
            "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
            if stream
            else chat.choices[0].message.content
        )
        assert text == want_chat, stream
        done = client.completions.create(prompt=prompt, stream=stream, **common)
        text = (
            "".join(c.choices[0].text for c in done if c.choices)
            if stream
            else done.choices[0].text
        )
        assert text == want_text, stream
    cluster.wait_baseline()


def test_logprobs_match_offline_streamed_and_not(
    cluster: Cluster, tokenizer: Tokenizer, offline_completion: Callable
) -> None:
    """Issue 19: completions `logprobs` and chat `logprobs`/`top_logprobs`, streamed and
    not, are the offline engine's, the first token's (sampled on the prefill node) too."""
    client = _client(cluster)
    model = _model(client)
    common = {"model": model, "max_tokens": 10, "temperature": 0.8, "seed": 5}
    common["extra_body"] = {"ignore_eos": True}
    prompt = "Once upon a time"
    want = offline_completion(
        tokenizer.encode(prompt),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=3),
    )
    texts = [tokenizer.token_bytes(t).decode("utf-8", "replace") for t in want.token_ids]
    full = client.completions.create(prompt=prompt, logprobs=3, **common)
    lp = full.choices[0].logprobs
    assert lp is not None and lp.tokens == texts and full.choices[0].text == "".join(texts)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert lp.text_offset == [sum(map(len, texts[:i])) for i in range(len(texts))]
    for top, w, text in zip(lp.top_logprobs, want.logprobs, texts, strict=True):
        expected = {tokenizer.token_bytes(t).decode("utf-8", "replace"): v for t, v in w.top}
        expected.setdefault(text, w.logprob)
        assert top == pytest.approx(expected, abs=1e-4)
    chunks = list(client.completions.create(prompt=prompt, logprobs=3, stream=True, **common))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == texts
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    want = offline_completion(
        tokenizer.encode_chat(messages),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=2),
    )
    for stream in (False, True):
        out = client.chat.completions.create(
            messages=messages, logprobs=True, top_logprobs=2, stream=stream, **common
        )
        if stream:
            content = [
                e
                for c in out
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content
            ]
        else:
            assert out.choices[0].logprobs is not None
            content = out.choices[0].logprobs.content
        assert [list(tokenizer.token_bytes(t)) for t in want.token_ids] == [
            e.bytes for e in content
        ]
        for e, w in zip(content, want.logprobs, strict=True):
            assert e.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [x.logprob for x in e.top_logprobs] == pytest.approx(
                [v for _, v in w.top], abs=1e-4
            )
            assert [x.bytes for x in e.top_logprobs] == [
                list(tokenizer.token_bytes(t)) for t, _ in w.top
            ]
    cluster.wait_baseline()


def test_echo_returns_the_prompt_and_its_logprobs(
    cluster: Cluster, tokenizer: Tokenizer, offline_completion: Callable
) -> None:
    """Issue 19: `echo` (what log-likelihood scoring sends: echo, logprobs, max_tokens 1),
    streamed and not; the prompt's logprobs are computed by the node that prefills."""
    client = _client(cluster)
    model = _model(client)
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    want = offline_completion(
        ids, SamplingParams(temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=2)
    )
    text = lambda t: tokenizer.token_bytes(t).decode("utf-8", "replace")  # noqa: E731
    completion = tokenizer.decode(want.token_ids)
    kw = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True}
    assert client.completions.create(**kw).choices[0].text == prompt + completion
    full = client.completions.create(logprobs=2, **kw)
    assert full.choices[0].text == prompt + completion
    lp = full.choices[0].logprobs
    assert lp is not None and lp.tokens == [text(t) for t in ids + want.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want_lps = [x.logprob for x in [*want.prompt_logprobs, *want.logprobs]]
    assert lp.token_logprobs[1:] == pytest.approx(want_lps, abs=1e-4)
    chunks = list(client.completions.create(logprobs=2, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + completion
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == lp.tokens
    cluster.wait_baseline()


def test_structured_output_constrains_every_token(cluster: Cluster) -> None:
    """Issue 19: guided_choice, guided_regex and response_format json_schema on the tiny
    model (sampled: its free text is noise, so only the constraint can make it conform),
    streamed and not; a constraint that does not compile is a 400."""
    client = _client(cluster)
    model = _model(client)
    messages = [{"role": "user", "content": "Pick one."}]
    common = {"model": model, "max_tokens": 40, "temperature": 1.0, "messages": messages}

    def ask(stream: bool, seed: int, **kw: object) -> tuple[str, str | None]:
        out = client.chat.completions.create(stream=stream, seed=seed, **common, **kw)  # type: ignore[call-overload]
        if stream:
            chunks = [c for c in out if c.choices]
            return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[
                0
            ].finish_reason
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    choices = ["alpha", "beta", "gamma delta"]
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    for seed in range(3):
        for stream in (False, True):
            text, reason = ask(stream, seed, extra_body={"guided_choice": choices})
            assert text in choices and reason == "stop", text
            text, reason = ask(stream, seed, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
            assert re.fullmatch("[0-9]{3}-[a-z]{2}", text) and reason == "stop", text
            text, reason = ask(stream, seed, response_format=fmt)
            obj = json.loads(text)
            assert set(obj) == {"color", "ok"} and obj["color"] in ("red", "green"), text
            assert isinstance(obj["ok"], bool) and reason == "stop"
    for bad, param in (
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
        ),
    ):
        with pytest.raises(openai.BadRequestError, match="does not compile") as refused:
            client.chat.completions.create(**common, **bad)  # type: ignore[call-overload]
        assert refused.value.param == param  # the client's field, not the node's name for it
    cluster.wait_baseline()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}


def test_tool_calls_streamed_and_not(cluster: Cluster) -> None:
    """Issue 19: tools with tool_choice "required" and a named function, constrained to the
    tools' schemas, returned as tool_calls (streamed as deltas); "auto" is a clear 400 for
    a chat template without a tool-call format; a conversation carrying the calls and the
    tool's answer goes on."""
    client = _client(cluster)
    model = _model(client)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    common = {"model": model, "max_tokens": 60, "temperature": 1.0, "messages": messages}
    tools = [WEATHER, TIME]

    def streamed(**kw: object) -> tuple[list[tuple[str, str]], str | None]:
        calls: dict[int, list[str]] = {}
        reason = None
        for chunk in client.chat.completions.create(stream=True, **common, **kw):  # type: ignore[call-overload]
            if not chunk.choices:
                continue
            reason = chunk.choices[0].finish_reason or reason
            for d in chunk.choices[0].delta.tool_calls or []:
                name_args = calls.setdefault(d.index, ["", ""])
                if d.function.name:
                    assert d.id and d.type == "function" and not name_args[0]
                    name_args[0] = d.function.name
                name_args[1] += d.function.arguments or ""
        return [(n, a) for n, a in (calls[i] for i in sorted(calls))], reason

    named = {"type": "function", "function": {"name": "get_weather"}}
    required_checked = 0
    for seed in range(4):
        full = client.chat.completions.create(tools=tools, tool_choice=named, seed=seed, **common)
        msg = full.choices[0].message
        assert full.choices[0].finish_reason == "stop" and msg.content is None
        assert msg.tool_calls is not None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert args["city"] in ("Paris", "Oslo") and isinstance(args["celsius"], bool)
        assert streamed(tools=tools, tool_choice=named, seed=seed) == (
            [("get_weather", call.function.arguments)],
            "stop",
        )
        one = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
        full = client.chat.completions.create(seed=seed, **one, **common)
        calls = full.choices[0].message.tool_calls
        if full.choices[0].finish_reason == "length":  # the tiny model may list many calls
            continue
        assert full.choices[0].finish_reason == "tool_calls" and calls
        assert all(c.function.name in ("get_weather", "get_time") for c in calls)
        for c in calls:
            json.loads(c.function.arguments)
        got, reason = streamed(seed=seed, **one)
        assert reason == "tool_calls"
        assert got == [(c.function.name, c.function.arguments) for c in calls]
        required_checked += 1
    assert required_checked, "every 'required' answer ran out of tokens"
    with pytest.raises(openai.BadRequestError, match="tool-call format"):
        client.chat.completions.create(tools=tools, **common)
    turn = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    again = client.chat.completions.create(
        **{**common, "messages": turn}, tools=tools, tool_choice="none"
    )
    assert again.choices[0].message.tool_calls is None
    cluster.wait_baseline()


def test_a_batch_of_prompts_streamed_and_not_and_cancelled(
    cluster: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """Issue 19: a list of prompts is one choice per prompt, in order, each its prompt's
    completion; a batch stream closed early leaves no request and no block behind."""
    client = _client(cluster)
    model = _model(client)
    prompts = ["Once upon a time", "The quick brown fox", "In a hole in the ground"]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [tokenizer.decode(offline_token_ids(tokenizer.encode(p), sp)) for p in prompts]
    kw = {"model": model, "prompt": prompts, "max_tokens": 8, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(**kw)
    assert [c.text for c in sorted(full.choices, key=lambda c: c.index)] == want
    got = [""] * len(prompts)
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == want
    long = {**kw, "prompt": prompts * 2, "max_tokens": 400}
    stream = client.completions.create(stream=True, **long)
    for i, _ in enumerate(stream):
        if i == 6:
            break
    stream.close()
    cluster.wait_baseline()


def test_n_choices_streamed_and_not_equal_offline_and_cancel_frees_every_block(
    cluster: Cluster, tokenizer: Tokenizer, offline_completion: Callable
) -> None:
    """Issue 19: `n` choices, the prompt prefilled and (disaggregated) its KV moved once,
    the decode node forking it: each choice the offline engine's (reproducible per seed,
    independent), streamed and not, both endpoints, usage counting the prompt once; an
    `n=4` stream closed mid-way frees every block, shared ones exactly once."""
    client = _client(cluster)
    model = _model(client)
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, n=3)
    common = {"model": model, "max_tokens": 10, "temperature": 0.9, "seed": 7, "n": 3}
    common["extra_body"] = {"ignore_eos": True}

    def offline(ids: list[int]) -> list[str]:
        done = offline_completion(ids, sp)
        return [tokenizer.decode(t) for t in [done.token_ids, *[t for t, _ in done.more_choices]]]

    def texts(out: object, stream: bool, chat: bool) -> list[str]:
        got: dict[int, str] = {}
        for chunk in out if stream else [out]:  # type: ignore[attr-defined]
            for c in chunk.choices:
                text = (c.delta.content if stream else c.message.content) if chat else c.text
                got[c.index] = got.get(c.index, "") + (text or "")
        return [got[i] for i in sorted(got)]

    prompt = "Once upon a time"
    messages = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    want, want_chat = offline(tokenizer.encode(prompt)), offline(tokenizer.encode_chat(messages))
    assert len(set(want)) == 3
    for stream in (False, True):
        done = client.completions.create(prompt=prompt, stream=stream, **common)
        assert texts(done, stream, False) == want, stream
        chat = client.chat.completions.create(messages=messages, stream=stream, **common)
        assert texts(chat, stream, True) == want_chat, stream

    def counts() -> list[float]:
        """Prompts prefilled on prefill nodes, KV blocks decode nodes got, requests decode
        nodes took, prompts the proxy placed on a decode node (prefilled there)."""
        nodes = cluster.nodes()
        decode = [p for p in nodes if p.name.startswith("decode")]
        kv = ("pdserve_kv_blocks_transferred_total", "pdserve_kv_blocks_cached_total")
        assert cluster.proxy is not None
        return [
            sum(_metric(p.url, "pdserve_node_requests_total", outcome="prefilled") for p in nodes),
            sum(_metric(p.url, name) for p in decode for name in kv),
            sum(_metric(p.url, "pdserve_node_requests_total", outcome="admitted") for p in decode),
            _metric(cluster.proxy.url, "pdserve_proxy_placements_total", placement="local"),
        ]

    fresh = "A prompt no node has seen, of several choices"
    before = counts()
    full = client.completions.create(prompt=fresh, **common)
    delta = [a - b for a, b in zip(counts(), before, strict=True)]
    if any(p.name.startswith("decode") for p in cluster.nodes()):  # one request, n choices
        n_blocks = -(-len(tokenizer.encode(fresh)) // 16)  # one prompt's KV, moved once
        local = delta[3] == 1  # conditional disaggregation placed it on the decode node
        assert delta == ([0, 0, 1, 1] if local else [1, n_blocks, 1, 0]), delta
    assert [c.finish_reason for c in full.choices] == ["length"] * 3
    assert full.usage is not None and full.usage.completion_tokens == 30
    assert full.usage.prompt_tokens == len(tokenizer.encode(fresh))
    long = {**common, "n": 4, "max_tokens": 400}
    stream = client.completions.create(prompt=prompt, stream=True, **long)
    seen: set[int] = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if len(seen) == 4:
            break
    stream.close()
    cluster.wait_baseline()


def test_a_choice_ended_by_a_stop_string_ends_on_its_node_alone(
    cluster: Cluster, tokenizer: Tokenizer, offline_completion: Callable
) -> None:
    """Issue 19: of `n` choices, one whose text meets a stop string ends there (finish
    "stop") and is cancelled on the node that decodes it, alone: the others run on to
    their length, each the offline engine's."""
    client = _client(cluster)
    model = _model(client)
    prompt = "The quick brown fox"
    sp = SamplingParams(temperature=0.9, seed=9, max_tokens=200, ignore_eos=True, n=3)
    done = offline_completion(tokenizer.encode(prompt), sp)
    full = [tokenizer.decode(t) for t in [done.token_ids, *[t for t, _ in done.more_choices]]]
    stop = next(
        full[1][i : i + 4]
        for i in range(1, len(full[1]) - 4)
        if full[1][i : i + 4] not in full[0] + full[2] and full[1].index(full[1][i : i + 4]) == i
        and "\ufffd" not in full[1][i : i + 4]
    )  # fmt: skip
    want = [(t, "length") if stop not in t else (t[: t.index(stop)], "stop") for t in full]
    assert [r for _, r in want] == ["length", "stop", "length"]
    deciders = [p for p in cluster.nodes() if not p.name.startswith("prefill")]

    def cancels() -> float:
        return sum(_metric(p.url, "pdserve_cancellations_total") for p in deciders)

    before = cancels()
    out = client.completions.create(
        model=model, prompt=prompt, n=3, max_tokens=200, temperature=0.9, seed=9, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [(c.text, c.finish_reason) for c in out.choices] == want
    # Choice 1 was cancelled while the others ran on (200 tokens): the node found it running.
    assert cancels() - before == 1  # choice 1, on the node decoding it; no whole cancel
    cluster.wait_baseline()


def test_a_repeated_prompt_reports_its_cached_tokens(
    cluster: Cluster, tokenizer: Tokenizer
) -> None:
    """Issue 14: usage.prompt_tokens_details.cached_tokens, streamed and not, on both
    endpoints. Of three identical requests, the second and third find the prompt cached: the
    router sends each where the first left it (with 2p2d and `auto` there are four nodes
    that could prefill it, and the node that had just computed the first no longer looks
    busy with it until its next poll: proxy/pool/sent.py)."""
    client = _client(cluster)
    model = _model(client)
    prompt = tokenizer.decode(tokenizer.encode(CORPUS)[:120])
    common = {"model": model, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    texts, cached, n_prompt = set(), [], 0
    for _ in range(3):
        full = client.completions.create(prompt=prompt, **common)
        assert full.usage is not None and full.usage.prompt_tokens_details is not None
        texts.add(full.choices[0].text)
        cached.append(full.usage.prompt_tokens_details.cached_tokens)
        n_prompt = full.usage.prompt_tokens
    assert len(texts) == 1 and min(cached[1:]) >= 0.75 * n_prompt, (cached, n_prompt)
    messages = [{"role": "user", "content": prompt}]
    chat_cached = []
    for _ in range(3):
        stream = client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **common
        )
        usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens_details is not None
        chat_cached.append(usage.prompt_tokens_details.cached_tokens)
        n_prompt = usage.prompt_tokens
    assert min(chat_cached[1:]) >= 0.75 * n_prompt, (chat_cached, n_prompt)
    cluster.wait_baseline()  # cached blocks are free blocks


def test_one_request_after_another_reuses_the_connections_to_the_nodes(
    cluster: Cluster,
) -> None:
    """A node ends each stream with its last line and the body's end in one write, so the
    proxy reads the end with the line and keeps the connection for its next call; a stream
    ended in two writes was often dropped, and the next call to that node opened a new
    connection (35 of 40 sequential requests on 1P1D)."""
    assert cluster.proxy is not None
    client = _client(cluster)
    common = {"model": _model(client), "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    name = "pdserve_proxy_node_connections_opened_total"
    before = _metric(cluster.proxy.url, name)
    for i in range(20):  # streamed and not, both endpoints
        if i % 2:
            list(client.completions.create(prompt=f"{i} apples", stream=True, **common))
        else:
            messages = [{"role": "user", "content": f"{i} pears"}]
            client.chat.completions.create(messages=messages, **common)
    opened = _metric(cluster.proxy.url, name) - before
    # At most one per node (the first call to it, or one whose idle connection lapsed).
    assert opened <= len(cluster.nodes()), opened


def test_concurrent_mixed_requests_match_offline_and_free_every_block(
    cluster: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    assert cluster.proxy is not None
    # Text prompts (slices of the tokenizer's corpus), so that no prompt ends inside
    # a multi-byte character and the streamed text equals decode(output ids).
    rng = random.Random(4)
    jobs = []
    for i in range(32):
        size = rng.choice([1, 4, 40, 200, 700, 1100])
        start = rng.randrange(0, len(CORPUS) - size)
        jobs.append((CORPUS[start : start + size], rng.randint(2, 32), i))
    client = openai.AsyncOpenAI(base_url=f"{cluster.proxy.url}/v1", api_key="x", timeout=120)
    model = _model(_client(cluster))

    async def one(prompt: str, n: int, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def all_jobs() -> list[tuple[str, str | None]]:
        return await asyncio.gather(*(one(*job) for job in jobs))

    results = asyncio.run(all_jobs())
    for (prompt, n, _), (text, reason) in zip(jobs, results, strict=True):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        want = offline_token_ids(tokenizer.encode(prompt), sp)
        assert text == tokenizer.decode(want)
        assert reason == "length"
    cluster.wait_baseline()


BODY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


Answer = tuple[int, str | None, str | None]  # status, error code and message's start


async def _one(session: aiohttp.ClientSession, url: str) -> Answer:
    async with session.post(f"{url}/v1/completions", json=BODY) as resp:
        body = await resp.json(content_type=None)
        if resp.status == 200:
            return 200, None, None
        assert resp.headers.get("Retry-After"), body
        return resp.status, body["error"]["code"], body["error"]["message"][:40]


async def _counters(session: aiohttp.ClientSession, proxy: str, prefill: str) -> Counter[str]:
    """The counters a burst moves: what the prefill node computed, what the decode node
    prefilled itself (conditional disaggregation), what the edge did."""
    return Counter(
        {
            "prefilled": await metric(session, prefill, "pdserve_node_requests_total"),
            "local": await metric(
                session, proxy, "pdserve_proxy_placements_total", placement="local"
            ),
            "admitted": await metric(
                session, proxy, "pdserve_edge_exits_total", outcome="admitted"
            ),
            "rejected": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="rejected"
            ),
            "at_edge": await metric(session, proxy, "pdserve_edge_rejections_total"),
            "completed": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="length"
            ),
            "failed": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="server_error"
            ),
            "cancelled": await metric(
                session, proxy, "pdserve_proxy_requests_total", outcome="cancelled"
            ),
        }
    )


def _burst(cluster: Cluster, n: int) -> tuple[list[Answer], Counter[str]]:
    """`n` requests sent at once; their answers, and how far each counter moved."""
    assert cluster.proxy is not None
    proxy = cluster.proxy.url
    prefill = _node(cluster, "prefill").url

    async def main() -> tuple[list[Answer], Counter[str]]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            before = await _counters(session, proxy, prefill)
            answers = await asyncio.gather(*(_one(session, proxy) for _ in range(n)))
            after = await _counters(session, proxy, prefill)
        moved = Counter({k: after[k] - before[k] for k in after})
        return answers, moved

    return asyncio.run(main())


@pytest.mark.parametrize("cluster", ["1p1d"], indirect=True)  # that cluster only
def test_a_burst_of_600_is_served_whole_from_the_edge_queue(
    cluster: Cluster,
) -> None:
    """Issue 18: 600 at once is more than the pipeline holds (the decode node's 64 sequences,
    as many waiting prefilled) but well inside the advertised capacity: all of it completes."""
    answers, moved = _burst(cluster, 600)
    assert Counter(status for status, _, _ in answers) == {200: 600}
    # Every prompt was computed once, on the prefill node or locally on the decode node.
    assert moved["prefilled"] + moved["local"] == moved["admitted"] == moved["completed"]
    assert moved["completed"] == 600
    assert moved["rejected"] == moved["failed"] == 0
    cluster.wait_baseline(timeout=30)


@pytest.mark.parametrize("cluster", ["1p1d"], indirect=True)  # that cluster only
def test_a_burst_beyond_capacity_is_refused_at_the_edge_only_for_the_excess(
    cluster: Cluster,
) -> None:
    """Issue 18: a burst of 3x a proxy's advertised capacity (max active + edge queue; a
    second proxy on the same nodes, sized down from the defaults' 1,536 so that the test is
    short): at least the capacity completes; the rest get 503 + Retry-After at the edge,
    before any node saw them: the prefill node computed exactly the requests that completed,
    none was refused after its prefill."""
    main = cluster.proxy
    small = cluster.start_proxy(
        [_node(cluster, "prefill")], [_node(cluster, "decode")],
        max_active_requests=64, edge_queue_capacity=128,
    )  # fmt: skip
    try:
        answers, moved = _burst(cluster, 600)
    finally:
        small.stop()
        cluster.proxy = main
    statuses = Counter(status for status, _, _ in answers)
    refused = [a for a in answers if a[0] != 200]
    assert statuses[200] >= 64 + 128, Counter(answers)
    assert {(status, code) for status, code, _ in refused} == {(503, "overloaded")}
    computed = moved["prefilled"] + moved["local"]  # on the prefill node or the decode node
    assert computed == moved["admitted"] == moved["completed"] == statuses[200]
    # the metrics add up: admitted = completed + cancelled + failed; refused = rejected
    assert moved["admitted"] == moved["completed"] + moved["cancelled"] + moved["failed"]
    assert moved["rejected"] == moved["at_edge"] == len(refused)
    cluster.wait_baseline(timeout=30)


@pytest.mark.parametrize("cluster", ["1p1d"], indirect=True)  # that cluster only
def test_a_decode_node_prefills_locally_when_placed_there(
    cluster: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """Issue 15 (conditional disaggregation): a proxy with `--disagg-mode never` in front of
    the same nodes sends each request straight to the decode node, which prefills it itself:
    the output equals the offline engine's, the prefill node computes nothing, the trace says
    where and why, a stream closed early is cancelled there, and every block comes back."""
    main = cluster.proxy
    prefill, decode = _node(cluster, "prefill"), _node(cluster, "decode")
    local = cluster.start_proxy([prefill], [decode], disagg_mode="never")
    try:
        prefilled_before = _metric(prefill.url, "pdserve_node_requests_total", outcome="prefilled")
        client = _client(cluster)
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        prompt = "The quick brown fox jumps"
        want = offline_token_ids(tokenizer.encode(prompt), sp)
        common = {"model": _model(client), "prompt": prompt, "temperature": 0}
        extra = {"extra_body": {"ignore_eos": True}}
        raw = client.completions.with_raw_response.create(max_tokens=16, **common, **extra)
        assert raw.parse().choices[0].text == tokenizer.decode(want)
        trace = http_json(f"{local.url}/debug/requests/{raw.headers['X-Request-Id']}/trace")
        (placed,) = [r for r in trace["rows"] if r["event"] == "placed"]
        assert placed["detail"].startswith("never: local (mode)"), placed
        assert f"decode {decode.url} est" in placed["detail"]
        owners = {r["owner"] for r in trace["rows"]}
        assert decode.url in owners and prefill.url not in owners
        stream = client.completions.create(max_tokens=400, stream=True, **common, **extra)
        for i, _ in enumerate(stream):  # leave mid-stream: cancelled on the decode node
            if i == 3:
                break
        stream.close()
        cluster.wait_baseline(timeout=30)
        after = _metric(prefill.url, "pdserve_node_requests_total", outcome="prefilled")
        assert after == prefilled_before
        assert _metric(local.url, "pdserve_proxy_placements_total", placement="local") == 2
    finally:
        local.stop()
        cluster.proxy = main


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples at `url`/metrics whose labels include `labels`."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), name, **labels)


def _node(cluster: Cluster, role: str) -> Server:
    return next(p for p in cluster.nodes() if p.name.startswith(role))


@pytest.mark.parametrize("cluster", ["2p2d"], indirect=True)  # that cluster only
def test_soak_with_random_disconnects_leaves_nothing_behind(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 5: `scripts/soak.py`, shortened, against 2P2D: random disconnects at random
    times, then every node at baseline, every completed output equal to offline, no errors."""
    assert cluster.proxy is not None
    out = tmp_path / "soak.json"
    argv = procs.python("scripts/soak.py", "--base-url", cluster.proxy.url)
    argv += ["--model", str(tiny_model_dir), "--requests", "60", "--concurrency", "12"]
    argv += ["--disconnect-prob", "0.4", "--max-drop-s", "0.8", "--max-tokens", "32"]
    argv += ["--seed", "7", "--json", str(out), "--no-progress"]
    proc = procs.run(argv, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["ok"] and all(summary["checks"].values()), summary
    assert summary["requests"] == 60
    assert summary["completed"] >= 10 and summary["disconnected"] >= 5, summary
    assert summary["completed"] + summary["disconnected"] == 60
    assert summary["proxy_outcomes"].get("cancelled", 0) >= 1
    cluster.wait_baseline()


def test_full_decode_pool_queues_then_completes(
    slow_2p2d: Cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """On a decode node that runs 2 sequences (the shared slow nodes, one pair of them),
    8 requests queue prefilled for it and all complete exactly."""
    by_name = {n.name: n for n in slow_2p2d.nodes()}
    # Through the inter-stage queue (auto could prefill some on the decode node instead).
    proxy = slow_2p2d.start_proxy(
        [by_name["prefill-0"]], [by_name["decode-0"]], disagg_mode="always"
    )
    try:
        _decode_pool_full(proxy, tokenizer, offline_token_ids)
    finally:
        proxy.stop()
    slow_2p2d.wait_baseline()


def _decode_pool_full(proxy: Server, tokenizer: Tokenizer, offline_token_ids: Callable) -> None:
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", timeout=120)
    prompts = [[7 + i, 8, 9, 10 + i] for i in range(8)]
    model = _model(openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0))

    async def one(prompt: list[int]) -> str:
        resp = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return resp.choices[0].text

    async def run() -> tuple[list[str], float]:
        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        peak = 0.0
        while not all(t.done() for t in tasks):
            peak = max(peak, _metric(proxy.url, "pdserve_interstage_queue_depth"))
            await asyncio.sleep(0.02)
        return await asyncio.gather(*tasks), peak

    texts, peak = asyncio.run(run())
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert texts == [tokenizer.decode(offline_token_ids(p, sp)) for p in prompts]
    waits = _metric(proxy.url, "pdserve_interstage_wait_seconds_count")
    assert waits >= len(prompts)
    assert peak >= 1, "no request ever waited in the inter-stage queue"


@pytest.mark.parametrize("cluster", ["1p1d"], indirect=True)  # that cluster only
def test_node_with_other_fingerprint_is_refused(
    cluster: Cluster,
) -> None:
    assert cluster.proxy is not None
    other = cluster.node("decode", "decode-bf16", dtype="bfloat16")
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            http_json(f"{cluster.proxy.url}/admin/nodes", {"url": other.url, "role": "decode"})
        assert 400 <= err.value.code < 500
        assert "fingerprint" in err.value.read().decode().lower()
        listed = http_json(f"{cluster.proxy.url}/admin/nodes")
        urls = [n["url"] for n in (listed["nodes"] if isinstance(listed, dict) else listed)]
        assert other.url not in urls
    finally:
        other.stop()


@pytest.mark.parametrize("backend", ["zmq", "ucxx"])
def test_every_kv_backend_serves_equal_to_offline(
    backend: str, tiny_model_dir: Path, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """nixl runs in every other test; the two-sided backends (their receivers accept bytes
    only into blocks reserved for an expected transfer) serve the same tokens, with a cluster
    token on (authenticated side channel, per-transfer keys)."""
    cluster = start_cluster(
        tiny_model_dir, (1, 1, 0), token="e2e-token-0123456789", kv_backend=backend
    )
    try:
        assert cluster.proxy is not None
        client = openai.OpenAI(base_url=f"{cluster.proxy.url}/v1", api_key="x", max_retries=0)
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = [f"Story {i}: the fox and the {w}" for i, w in enumerate(CORPUS.split()[:6])]
        for prompt in prompts:
            out = client.completions.create(
                model=_model(client), prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.choices[0].text == tokenizer.decode(
                offline_token_ids(tokenizer.encode(prompt), sp)
            )
        cluster.wait_baseline()
    finally:
        cluster.close()


def test_decode_nodes_connect_to_every_prefill_node_before_any_request(
    tiny_model_dir: Path,
) -> None:
    """The proxy tells each decode node the prefill nodes' KV side channels as it polls
    them, and the decode node makes the KV-transfer handshake with each at once: the first
    request between a pair does not wait for it (~30 ms over UCX here). Before, a decode
    node knew no prefill node until a request from it arrived."""
    with start_cluster(tiny_model_dir, (2, 2, 0)) as cluster:
        prefill = [n for n in cluster.nodes() if n.name.startswith("prefill")]
        decode = [n for n in cluster.nodes() if n.name.startswith("decode")]
        channels = sorted(p.state()["kv_transfer"]["side_channel"] for p in prefill)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            peers = [d.state()["kv_transfer"]["peers"] for d in decode]
            if peers == [2, 2]:
                break
            time.sleep(0.1)
        assert peers == [2, 2], peers  # no request was sent
        for p in prefill:
            assert p.state()["kv_transfer"]["peers"] == 2
        # Told again (the same side channels, twice in one call): nothing new to connect.
        url = decode[0].url + "/internal/kv_peers"
        body = {"type": "kv_peers", "side_channels": channels + channels[:1]}
        answer = http_json(url, body)
        assert (answer["type"], answer["connecting"], answer["known"]) == ("kv_peers_result", 0, 2)
        # One that answers no handshake: the call answers at once, the node stays healthy,
        # and it keeps its two peers.
        body = {"type": "kv_peers", "side_channels": ["tcp://127.0.0.1:9"]}
        assert http_json(url, body)["connecting"] == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            http_json(url, {"type": "kv_peers", "side_channels": ["x"] * 257})
        assert e.value.code == 400
        assert decode[0].state()["kv_transfer"]["peers"] == 2
        client = _client(cluster)
        common = {"model": _model(client), "max_tokens": 4, "extra_body": {"ignore_eos": True}}
        assert client.completions.create(prompt="one more", **common).choices[0].text
        cluster.wait_baseline()
