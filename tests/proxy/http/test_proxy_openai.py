"""The `openai` client, unchanged, against the proxy over the in-process engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from common.wire.sampling_params import SamplingParams
from tests.support.proxy_harness import MAX_MODEL_LEN, MODEL, OfflineEngine, ProxyHarness

CHAT_PROMPT = "Hello, who are you?"
TEXT_PROMPT = "The quick brown fox"


@pytest.fixture()
def client(proxy: ProxyHarness) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{proxy.base_url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c
    proxy.wait_idle()


def _greedy(
    offline_engine: OfflineEngine, ids: list[int], max_tokens: int, **kw: Any
) -> tuple[list[int], str]:
    return offline_engine.generate(
        ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    )


def _stream_chat(client: OpenAI, **kw: Any) -> tuple[list[Any], str, str | None]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return chunks, text, reasons[-1]


def _stream_completion(client: OpenAI, **kw: Any) -> tuple[list[Any], str, str | None]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return chunks, text, reasons[-1]


def test_chat_stream_and_full_match_offline_greedy(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine
) -> None:
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    ids = proxy.tokenizer.encode_chat(messages)
    want_ids, want_reason = _greedy(offline_engine, ids, 24)
    want = proxy.tokenizer.decode(want_ids)

    chunks, text, reason = _stream_chat(client, messages=messages, max_tokens=24, temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert (text, reason) == (want, want_reason)

    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert (full.choices[0].message.content, full.choices[0].finish_reason) == (want, reason)
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.completion_tokens == len(want_ids)
    assert full.usage.total_tokens == len(ids) + len(want_ids)


def test_completion_stream_and_full_match_offline_greedy(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine
) -> None:
    ids = proxy.tokenizer.encode(TEXT_PROMPT)
    want_ids, _ = _greedy(offline_engine, ids, 20, ignore_eos=True)
    want = proxy.tokenizer.decode(want_ids)
    kw: dict[str, Any] = dict(prompt=TEXT_PROMPT, max_tokens=20, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}

    chunks, text, reason = _stream_completion(client, **kw)
    assert (text, reason) == (want, "length")
    assert all(c.id.startswith("cmpl-") and c.object == "text_completion" for c in chunks)

    full = client.completions.create(model=MODEL, **kw)
    assert (full.choices[0].text, full.choices[0].finish_reason) == (want, "length")
    assert full.usage is not None and full.usage.completion_tokens == 20

    by_ids = client.completions.create(model=MODEL, **{**kw, "prompt": ids})
    assert by_ids.choices[0].text == want


def test_include_usage_adds_a_final_usage_chunk(client: OpenAI, proxy: ProxyHarness) -> None:
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    chunks, _, reason = _stream_chat(
        client,
        messages=messages,
        max_tokens=7,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    n_prompt = len(proxy.tokenizer.encode_chat(messages))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (n_prompt, 7)
    assert last.usage.total_tokens == n_prompt + 7

    plain, _, _ = _stream_chat(client, messages=messages, max_tokens=3, temperature=0)
    assert all(c.usage is None and c.choices for c in plain)


def test_max_tokens_finishes_with_length(client: OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_default_max_tokens_fills_the_context(client: OpenAI, proxy: ProxyHarness) -> None:
    ids = proxy.tokenizer.encode(TEXT_PROMPT)
    prompt = (ids * MAX_MODEL_LEN)[: MAX_MODEL_LEN - 3]
    out = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 3


def _boundary_stop(proxy: ProxyHarness, ids: list[int]) -> tuple[str, str]:
    """A stop string that starts inside one output token's text and ends inside the next
    one's, and the text expected before it."""
    tok = proxy.tokenizer
    full = tok.decode(ids)
    for i in range(3, len(ids) - 1):
        a, b = len(tok.decode(ids[:i])), len(tok.decode(ids[: i + 1]))
        c = len(tok.decode(ids[: i + 2]))
        if 0 < a < b - 1 and b < c and full[:b] == tok.decode(ids[: i + 1]):
            stop = full[b - 2 : b + 1]
            if "\ufffd" not in stop:
                return stop, full[: full.find(stop)]
    raise AssertionError("no token boundary found to place a stop string on")


def test_stop_string_across_tokens(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine
) -> None:
    ids = proxy.tokenizer.encode(TEXT_PROMPT)
    want_ids, _ = _greedy(offline_engine, ids, 40, ignore_eos=True)
    stop, want = _boundary_stop(proxy, want_ids)
    kw: dict[str, Any] = dict(prompt=TEXT_PROMPT, max_tokens=40, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}

    for stops in (stop, ["\x00never", stop]):
        chunks, text, reason = _stream_completion(client, stop=stops, **kw)
        assert (text, reason) == (want, "stop")
        full = client.completions.create(model=MODEL, stop=stops, **kw)
        assert (full.choices[0].text, full.choices[0].finish_reason) == (want, "stop")
        assert full.usage is not None and full.usage.completion_tokens < 40  # cancelled early


def test_partial_stop_at_end_is_flushed(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine
) -> None:
    ids = proxy.tokenizer.encode(TEXT_PROMPT)
    want_ids, _ = _greedy(offline_engine, ids, 12, ignore_eos=True)
    want = proxy.tokenizer.decode(want_ids)
    stop = want[-2:] + "\x00tail"  # its first two characters end the output; it never completes
    kw: dict[str, Any] = dict(prompt=TEXT_PROMPT, max_tokens=12, temperature=0, stop=stop)
    chunks, text, reason = _stream_completion(client, extra_body={"ignore_eos": True}, **kw)
    assert (text, reason) == (want, "length")
    # The possible stop prefix was held back until the end, then flushed with the finish.
    assert chunks[-1].choices[0].text.endswith(want[-2:])
    assert not "".join(c.choices[0].text for c in chunks[:-1]).endswith(want[-2:])


def test_stop_token_ids_are_not_rendered(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine
) -> None:
    ids = proxy.tokenizer.encode(TEXT_PROMPT)
    want_ids, _ = _greedy(offline_engine, ids, 16, ignore_eos=True)
    stop_id = want_ids[5]
    cut = want_ids.index(stop_id)
    out = client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == proxy.tokenizer.decode(want_ids[:cut])
    assert out.usage is not None and out.usage.completion_tokens == cut + 1


def test_seeded_sampling_is_reproducible(client: OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=TEXT_PROMPT, max_tokens=8, temperature=0.9)
    kw["seed"] = 7
    kw["top_p"] = 0.9
    a = client.completions.create(**kw, extra_body={"top_k": 50})
    b = client.completions.create(**kw, extra_body={"top_k": 50})
    assert a.choices[0].text == b.choices[0].text


def test_models_lists_the_model(client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_echo_with_logprobs_over_the_engine(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine
) -> None:
    full = client.completions.create(
        model=MODEL, prompt=TEXT_PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    lp = full.choices[0].logprobs
    ids = proxy.tokenizer.encode(TEXT_PROMPT)
    assert full.choices[0].text.startswith(TEXT_PROMPT)
    assert lp is not None and len(lp.tokens) == len(ids) + 2, lp
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_gives_one_choice_each_in_order(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine, stream: bool
) -> None:
    """Issue 19: `prompt` as a list (texts or token arrays): one choice per prompt, in
    order (`index`), each its prompt's own completion; usage counts them all."""
    texts = ["The quick brown fox", "Once upon a time", "Hello"]
    ids = [proxy.tokenizer.encode(t) for t in texts]
    want = [proxy.tokenizer.decode(_greedy(offline_engine, x, 6, ignore_eos=True)[0]) for x in ids]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    for prompt in (texts, ids):
        if stream:
            got = [""] * len(texts)
            chunks = list(client.completions.create(prompt=prompt, stream=True, **kw))
            for c in chunks:
                for choice in c.choices:
                    got[choice.index] += choice.text
            reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
            assert sorted(reasons) == ["length"] * len(texts)
        else:
            full = client.completions.create(prompt=prompt, **kw)
            assert [c.index for c in full.choices] == [0, 1, 2]
            got = [c.text for c in full.choices]
            assert full.usage is not None and full.usage.completion_tokens == 18
            assert full.usage.prompt_tokens == sum(map(len, ids))
        assert got == want


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_the_offline_engines_each_in_order(
    client: OpenAI, proxy: ProxyHarness, offline_engine: OfflineEngine, stream: bool
) -> None:
    """Issue 19: `n` choices of one prompt (one prefill, forked where it decodes): choice j
    is the offline engine's choice j (its seed derived from the request's), on both
    endpoints; with a batch of prompts, prompt i's choice j is choice i * n + j; usage
    counts each prompt once and every completion."""
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True, n=3)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0.9, "seed": 7, "n": 3}
    kw["extra_body"] = {"ignore_eos": True}

    def choices(out: Any, chat: bool) -> list[str]:
        if not stream:
            assert [c.index for c in out.choices] == list(range(len(out.choices)))
            return [c.message.content if chat else c.text for c in out.choices]
        got: dict[int, str] = {}
        for c in out:
            for ch in c.choices:
                got[ch.index] = got.get(ch.index, "") + (
                    (ch.delta.content or "") if chat else ch.text
                )
        return [got[i] for i in sorted(got)]

    texts = ["The quick brown fox", "Once upon a time"]
    ids = [proxy.tokenizer.encode(t) for t in texts]
    want = [proxy.tokenizer.decode(t) for x in ids for t, _ in offline_engine.choices(x, sp)]
    assert len(set(want)) == 6  # independent draws
    assert (
        choices(client.completions.create(prompt=texts[0], stream=stream, **kw), False) == want[:3]
    )
    assert choices(client.completions.create(prompt=texts, stream=stream, **kw), False) == want
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    chat_ids = proxy.tokenizer.encode_chat(messages)
    want_chat = [proxy.tokenizer.decode(t) for t, _ in offline_engine.choices(chat_ids, sp)]
    got = choices(client.chat.completions.create(messages=messages, stream=stream, **kw), True)
    assert got == want_chat
    if not stream:
        full = client.completions.create(prompt=texts, **kw)
        assert full.usage is not None and full.usage.completion_tokens == 6 * 6
        assert full.usage.prompt_tokens == sum(map(len, ids))


def test_n_choices_each_carry_their_own_logprobs_and_echo(
    client: OpenAI, proxy: ProxyHarness
) -> None:
    """Issue 19: with `n`, every choice has its own tokens' logprobs, and `echo` returns the
    prompt (and its logprobs, computed once) in front of each."""
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0.9, "seed": 3}
    kw["extra_body"] = {"ignore_eos": True}
    out = client.completions.create(prompt=TEXT_PROMPT, n=2, logprobs=2, echo=True, **kw)
    assert [c.index for c in out.choices] == [0, 1]
    n_prompt = len(proxy.tokenizer.encode(TEXT_PROMPT))
    for c in out.choices:
        lp = c.logprobs
        assert lp is not None and c.text.startswith(TEXT_PROMPT)
        assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 5
        assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    first, second = (c.logprobs for c in out.choices)
    assert first.token_logprobs[:n_prompt] == second.token_logprobs[:n_prompt]
    assert first.tokens[n_prompt:] != second.tokens[n_prompt:]
