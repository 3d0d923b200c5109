"""Issue 5: a property-based fuzz of the HTTP surfaces with generated bad requests, against a
real 1P1D cluster. Every bad request gets a 4xx with an OpenAI-style error body; none gets a
5xx, crashes a process, or leaks a block; valid requests keep working alongside.

Each generated request is a valid request with one defect drawn from a catalogue (a wrong
type, an out-of-range or unsupported value, an unknown model, an empty or over-long prompt,
broken JSON, invalid UTF-8, a wrong content type), so that it is bad by construction.
The internal node APIs get random JSON and bytes, and must answer 4xx the same way.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from common.wire import messages as wire_messages
from tests.support.cluster import Cluster, start_cluster
from tests.support.http import http_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_LEN = 2048  # the default model's context
VOCAB = 2816
ERROR_KEYS = {"message", "type", "param", "code"}
FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    c = start_cluster(tiny_model_dir, (1, 1, 0))
    try:
        yield c
    finally:
        c.close()


def post(url: str, data: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# -- the catalogue of defects ------------------------------------------------------------------

not_int = st.one_of(
    st.text(max_size=5),
    st.floats(allow_nan=False),
    st.lists(st.integers(), max_size=2),
    st.booleans(),
)
not_number = st.one_of(
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.booleans(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
)
not_text = st.one_of(
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)

FIELD_DEFECTS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(max_value=0), st.integers(MAX_LEN, 2**40), not_int),
    "temperature": st.one_of(
        st.floats(max_value=-1e-6, allow_nan=False), st.floats(2.0001, 1e9), not_number
    ),
    "top_p": st.one_of(
        st.floats(max_value=0.0, allow_nan=False), st.floats(1.0001, 1e9), not_number
    ),
    "top_k": st.one_of(st.integers(max_value=-2), not_int),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(2**63, 2**70), not_int),
    "n": st.one_of(st.integers(2, 100), st.integers(max_value=0), not_int),
    "presence_penalty": st.floats(2.01, 1e6) | st.floats(-1e6, -2.01),
    "frequency_penalty": st.floats(2.01, 1e6) | not_number,
    "repetition_penalty": st.floats(max_value=0.0, allow_nan=False) | not_number,
    "min_tokens": st.integers(3, 100),  # above max_tokens (2)
    "stop": st.one_of(
        st.just(""),
        st.lists(st.text(min_size=1, max_size=3), min_size=5, max_size=8),
        st.integers(),
    ),
    "stop_token_ids": st.one_of(
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3), st.text(min_size=1, max_size=3)
    ),
    "stream": st.one_of(st.integers(2, 9), st.text(min_size=1, max_size=4)),
    "ignore_eos": st.one_of(st.integers(2, 9), st.text(min_size=1, max_size=4)),
    "logit_bias": st.one_of(
        st.dictionaries(st.integers(0, 99).map(str), st.floats(100.01, 1e6), min_size=1),
        st.dictionaries(st.integers(VOCAB, 2**31).map(str), st.floats(-1, 1), min_size=1),
        st.dictionaries(st.text(alphabet="xyz-", min_size=1), st.floats(-1, 1), min_size=1),
    ),
    "guided_regex": st.sampled_from(["a(b", "[z-a]", "(?<x"]),
    "guided_choice": st.one_of(st.just([]), st.lists(st.integers(), min_size=1, max_size=2)),
    "an_unknown_field": st.integers(),
}
COMPLETION_DEFECTS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        st.just(""),
        st.just([]),
        st.lists(st.integers(VOCAB, 2**31), min_size=1, max_size=4),  # ids outside the vocab
        st.lists(st.integers(max_value=-1), min_size=1, max_size=4),
        st.integers(0, MAX_LEN).map(lambda n: [1] * (MAX_LEN + n)),  # beyond the context
        st.lists(st.text(min_size=1, max_size=3), min_size=257, max_size=260),  # too many
        not_text,
    ),
    "echo": st.integers(2, 9),
    "logprobs": st.integers(21, 100) | st.integers(max_value=-1),
    "best_of": st.integers(2, 5),
}
CHAT_DEFECTS: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.one_of(
        st.just([]),
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.text(max_size=6).filter(
                        lambda r: r not in ("system", "developer", "user", "assistant", "tool")
                    ),
                    "content": st.text(max_size=5),
                }
            ),
            min_size=1,
            max_size=2,
        ),
        st.lists(st.fixed_dictionaries({"content": st.text(max_size=5)}), min_size=1, max_size=2),
        st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": not_text}),
            min_size=1,
            max_size=2,
        ),
        not_text,
    ),
    "max_completion_tokens": st.integers(max_value=0),
    "top_logprobs": st.integers(0, 5),  # without logprobs
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["xml", "json", ""])}),
        st.just({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
    ),
    "tool_choice": st.sampled_from(["required", "auto"]),  # without tools
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}), min_size=1),
}


@st.composite
def bad_request(draw: st.DrawFn, model: str) -> tuple[str, bytes, str]:
    """(path, body, content type) of a request with exactly one defect."""
    chat = draw(st.booleans())
    unknown_model = {"model": st.text(min_size=1, max_size=20).filter(lambda m: m != model)}
    if chat:
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        defects = {**FIELD_DEFECTS, **CHAT_DEFECTS, **unknown_model}
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": "Once upon a time"}
        defects = {**FIELD_DEFECTS, **COMPLETION_DEFECTS, **unknown_model}
    body["max_tokens"] = 2
    kind = draw(st.sampled_from(["field", "missing", "json", "utf8", "content_type", "not_object"]))
    content_type = "application/json"
    if kind == "field":
        name = draw(st.sampled_from(sorted(defects)))
        body[name] = draw(defects[name])
        data = json.dumps(body).encode()
    elif kind == "missing":
        del body["messages" if chat else "prompt"]
        data = json.dumps(body).encode()
    elif kind == "json":
        text = json.dumps(body)
        cut = draw(st.integers(1, len(text) - 1))
        data = (text[:cut] + draw(st.sampled_from(["", "}", "]]", ",", "\x00", "{{"]))).encode()
        assume(not _parses(data))  # a cut before `, "max_tokens": 2` plus "}" is valid JSON
    elif kind == "utf8":
        text = json.dumps(body).encode()
        at = text.index(b"hi" if chat else b"Once")
        junk = draw(
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
        )
        data = text[:at] + junk + text[at:]
    elif kind == "content_type":
        data = json.dumps(body).encode()
        content_type = draw(
            st.sampled_from(
                [
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "application/json; charset=latin-1",
                ]
            )
        )
    else:
        data = json.dumps(
            draw(
                st.one_of(
                    st.lists(st.integers(), max_size=3),
                    st.integers(),
                    st.text(max_size=5),
                    st.none(),
                )
            )
        ).encode()
    return path, data, content_type


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _check_error(status: int, raw: bytes) -> None:
    assert 400 <= status < 500, (status, raw[:300])
    err = json.loads(raw)["error"]
    assert ERROR_KEYS <= set(err), err
    assert isinstance(err["message"], str) and err["message"]


def test_bad_requests_get_4xx_openai_errors_and_leave_no_trace(cluster: Cluster) -> None:
    assert cluster.proxy is not None
    proxy = cluster.proxy.url
    model = http_json(f"{proxy}/v1/models")["data"][0]["id"]
    seen: set[int] = set()

    @FUZZ
    @given(bad_request(model))
    def one(case: tuple[str, bytes, str]) -> None:
        path, data, content_type = case
        status, raw = post(proxy + path, data, content_type)
        _check_error(status, raw)
        seen.add(status)

    one()
    # An oversized body: 413, and the connection is not left in a bad state.
    big = json.dumps({"model": model, "prompt": "x" * (5 * 2**20)}).encode()
    status, raw = post(proxy + "/v1/completions", big)
    assert status == 413
    _check_error(status, raw)
    assert {400, 415} <= seen
    # Everything still serves, and nothing leaked.
    ok = http_json(f"{proxy}/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 3})
    assert ok["choices"][0]["finish_reason"] in ("stop", "length")
    for proc in cluster.procs:
        assert proc.alive(), proc.log_tail()
    cluster.wait_baseline()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
MESSAGE_TYPES = [
    "prefill_request",
    "decode_request",
    "generate_request",
    "lease_extend",
    "cancel",
    "token_delta",
    "nonsense",
]


@st.composite
def internal_body(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["typed", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    value = draw(json_values)
    if kind == "typed":  # a message type with fields of random shapes
        fields = draw(
            st.dictionaries(
                st.sampled_from(
                    [
                        "request_id",
                        "prompt_token_ids",
                        "sampling",
                        "lease_s",
                        "kv",
                        "first_token_id",
                        "request_ids",
                    ]
                ),
                json_values,
                max_size=4,
            )
        )
        value = {"type": draw(st.sampled_from(MESSAGE_TYPES)), **fields}
    return json.dumps(value).encode()


def test_internal_apis_reject_malformed_messages(cluster: Cluster) -> None:
    prefill, decode = cluster.nodes()
    routes = [
        (prefill, "/internal/prefill"),
        (prefill, "/internal/extend"),
        (prefill, "/internal/cancel"),
        (decode, "/internal/decode"),
        (decode, "/internal/cancel"),
    ]

    @settings(FUZZ, max_examples=150)
    @given(st.sampled_from(range(len(routes))), internal_body())
    def one(route: int, data: bytes) -> None:
        node, path = routes[route]
        status, raw = post(node.url + path, data)
        if status == 200:  # only a well-formed message may pass (a cancel of an unknown id)
            assert path == "/internal/cancel" and json.loads(raw)["found"] in (True, False)
            return
        _check_error(status, raw)

    one()
    for proc in cluster.procs:
        assert proc.alive(), proc.log_tail()
    cluster.wait_baseline()


def test_a_decode_request_that_lies_about_its_prefill_is_refused(cluster: Cluster) -> None:
    """Issue 13's crash: after a real prefill, a DecodeRequest for the same handle whose
    first token is outside the vocabulary reached the embedding and killed the decode
    engine thread. Every claim the request or its handle makes is now checked first."""
    from common.wire.node_messages import DecodeRequest, PrefillRequest, PrefillResult, to_json
    from common.wire.sampling_params import SamplingParams

    prefill, decode = cluster.nodes()
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = list(range(5, 45))  # 40 tokens: 3 blocks of 16
    status, raw = post(
        prefill.url + "/internal/prefill",
        to_json(
            PrefillRequest(
                request_id="liar", prompt_token_ids=prompt, sampling=sampling, lease_s=60
            )
        ),
    )
    assert status == 200, raw
    result = PrefillResult.model_validate_json(raw)
    assert result.kv is not None
    kv = result.kv
    good = DecodeRequest(
        request_id="liar", prompt_token_ids=prompt, first_token_id=result.first_token_id,
        sampling=sampling, kv=kv,
    )  # fmt: skip
    lies = {
        "first token outside the vocabulary": {"first_token_id": 10**9},
        "negative first token": {"first_token_id": -1},
        "a prompt token outside the vocabulary": {"prompt_token_ids": [*prompt[:-1], VOCAB]},
        "a short handle": {"kv": kv.model_copy(update={"num_tokens": 16, "num_blocks": 1})},
        "a handle longer than the prompt": {"prompt_token_ids": prompt[:20]},
        "blocks that do not match the tokens": {"kv": kv.model_copy(update={"num_blocks": 2})},
        "max_tokens beyond the context": {
            "sampling": sampling.model_copy(update={"max_tokens": 10**6})
        },
    }
    for what, change in lies.items():
        status, raw = post(decode.url + "/internal/decode", to_json(good.model_copy(update=change)))
        assert 400 <= status < 500, (what, status, raw)
        _check_error(status, raw)
        with urllib.request.urlopen(decode.url + "/health", timeout=10) as health:
            assert health.status == 200, what
    # The right handle with a made-up transfer key: the prefill node refuses the transfer as
    # if the id were unknown, counts it, and keeps the KV for its rightful taker.
    forged = kv.model_copy(update={"transfer_key": "guessed-key-0123456789"})
    status, raw = post(
        decode.url + "/internal/decode", to_json(good.model_copy(update={"kv": forged}))
    )
    assert status == 200, raw
    last = json.loads(raw.decode().splitlines()[-1])
    assert last["error"] and "unknown, expired or already sent" in last["error"], last
    with urllib.request.urlopen(prefill.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'pdserve_transfer_refusals_total{reason="bad_key"} 1.0' in metrics
    deadline = time.monotonic() + 10
    while decode.state()["requests"]["reserved"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the refused reservation is freed once quiescent
    # The held KV is untouched by the refusals: the true request still decodes from it.
    status, raw = post(decode.url + "/internal/decode", to_json(good))
    assert status == 200, raw
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["error"] is None
    assert sum(len(line["token_ids"]) for line in lines) == 3  # the first came from prefill
    for proc in cluster.procs:
        assert proc.alive(), proc.log_tail()
    cluster.wait_baseline()


# -- the KV side channel ----------------------------------------------------------------------

# msgpack carries integers in [-2**63, 2**64): JSON's unbounded ones do not fit a frame.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
side_values = st.one_of(
    msgpack_values,
    st.binary(max_size=64),
    st.lists(st.integers(-(2**40), 2**40), max_size=6),  # block ids, in range or far out
)


@st.composite
def side_message(draw: st.DrawFn) -> bytes:
    """A msgpack frame shaped like a side-channel message of any registered type (or none),
    with random fields, or random bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=256))
    tag = draw(st.sampled_from([*sorted(wire_messages._REGISTRY), "nonsense"]))
    fields = draw(st.dictionaries(st.sampled_from(SIDE_FIELDS), side_values, max_size=6))
    return msgpack.packb({"type": tag, "version": draw(st.sampled_from([1, 1, 2])), **fields})


SIDE_FIELDS = [
    "request_id", "dst_agent", "dst_engine_id", "dst_block_ids", "src_agent", "xfer_id",
    "part", "parts", "reason", "agent_name", "nonce", "proof", "peer", "accepted", "code",
    "transfer_key", "sent_at", "error",
]  # fmt: skip


def test_side_channels_survive_malformed_and_forged_messages(cluster: Cluster) -> None:
    """Every message type, well-formed or not, from a peer that never handshook: each node
    answers or drops it, stays healthy, leaks nothing, and still transfers KV."""
    nodes = cluster.nodes()
    addresses = [n.state()["kv_transfer"]["side_channel"] for n in nodes]
    ctx = zmq.Context.instance()
    socks = []
    for i, address in enumerate(addresses):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"fuzzer-{i}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
    try:

        @settings(FUZZ, max_examples=200)
        @given(st.sampled_from(range(len(socks))), side_message())
        def one(node: int, frame: bytes) -> None:
            socks[node].send(frame)
            while socks[node].poll(0):
                socks[node].recv()  # whatever it answered (a Reject): drained, not judged

        one()
        time.sleep(0.5)  # the last frames are handled
    finally:
        for sock in socks:
            sock.close()
    for proc in cluster.procs:
        assert proc.alive(), proc.log_tail()
    for node in nodes:
        kv = node.state()["kv_transfer"]
        assert kv["step_errors"] == 0 and kv["rejected_messages"] > 0, kv
    assert cluster.proxy is not None
    ok = http_json(f"{cluster.proxy.url}/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert ok["choices"][0]["finish_reason"] in ("stop", "length")
    cluster.wait_baseline()
