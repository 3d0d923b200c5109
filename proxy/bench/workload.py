"""bench-serve workloads: what each benchmark request asks for.

Three sources, all deterministic for a given seed:

- random (like vLLM's random dataset): prompt and output lengths drawn uniformly from
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]``; the prompt is random common English
  words, after a shared prefix of ``prefix_len`` words (the same for every request of a
  seed, as vLLM's ``--random-prefix-len``: the prefix-cache workload), or one of
  ``num_prefixes`` such prefixes, picked with Zipf weights ``1/k**prefix_zipf`` (tenants
  with their own system prompts, some busier than others). Without a tokenizer
  a word stands for a token (common words are one token in large BPE vocabularies; a small
  vocabulary makes prompts longer in tokens: the usage chunk's ``prompt_tokens`` is what
  gets reported). With ``--tokenizer DIR`` the words are encoded, cut to the drawn length
  and decoded, so the prompt is that many tokens up to re-encoding drift at the cut.
- conversations (chat only): sessions of ``turns`` requests sharing one system prompt of
  ``system_len`` words (the same for every session of a seed); turn t sends the system
  prompt, every earlier user message and the answer the server gave to it, and a new user
  message, after ``think_time_s`` (so each prompt contains the previous answer, as in a
  multi-turn chat: the prefix-cache workload).
- a JSONL file: one object per line, ``{"prompt": str, "max_tokens"?: int}`` or
  ``{"messages": [...], "max_tokens"?: int}``; lines are shuffled with the seed and reused
  in turn when more requests are sent than the file holds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Short, frequent English words: one token each in the usual 32k-150k BPE vocabularies.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may part "
    "over new sound take only little work know place year live me back give most very after "
    "thing our just name good sentence man think say great where help through much before line "
    "right too mean old any same tell boy follow came want show also around form three small "
    "set put end does another well large must big even such because turn here why ask went men "
    "read need land different home us move try kind hand picture again change off play spell "
    "air away animal house point page letter mother answer found study still learn should world"
).split()


class TokenCounter(Protocol):
    """The part of a tokenizer the random workload uses."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class WorkItem:
    """One request's content: a prompt (completions) or messages (chat), and its output cap."""

    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return list(self.messages)
        return [{"role": "user", "content": self.prompt or ""}]


@dataclass(frozen=True)
class RandomWorkload:
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0  # shared by every request, before its own input_len tokens
    # Several shared prefixes (tenants' system prompts, documents): each request takes one,
    # the k-th (from 1) with weight 1 / k**prefix_zipf (0: uniform).
    num_prefixes: int = 1
    prefix_zipf: float = 0.0
    # The prefixes' own seed (None: the run's): a warm-up run with another seed but this one
    # sends the measured run's prefixes, so caches start warm without repeating its prompts.
    prefix_seed: int | None = None

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len must be >= 0, got {self.prefix_len}")
        if self.num_prefixes < 1 or self.prefix_zipf < 0:
            raise ValueError("--num-prefixes must be >= 1 and --prefix-zipf >= 0")

    def lengths(self, rng: random.Random) -> tuple[int, int]:
        return _draw(rng, self.input_len, self.range_ratio), _draw(
            rng, self.output_len, self.range_ratio
        )

    def items(self, seed: int, tokenizer: TokenCounter | None = None) -> Iterator[WorkItem]:
        """An endless stream of requests (the load loop bounds it)."""
        rng = random.Random(seed)
        prefixes = [""]
        if self.prefix_len:
            ps = seed if self.prefix_seed is None else self.prefix_seed
            names = [f"prefix-{ps}"] + [f"prefix-{ps}-{k}" for k in range(1, self.num_prefixes)]
            prefixes = [_prompt(random.Random(n), self.prefix_len, tokenizer) + " " for n in names]
        weights = [1 / (k + 1) ** self.prefix_zipf for k in range(len(prefixes))]
        picker = random.Random(f"pick-{seed}")  # (the lengths' and words' draws stay as without)
        while True:
            n_in, n_out = self.lengths(rng)
            prefix = picker.choices(prefixes, weights)[0] if len(prefixes) > 1 else prefixes[0]
            yield WorkItem(max_tokens=n_out, prompt=prefix + _prompt(rng, n_in, tokenizer))


@dataclass(frozen=True)
class Session:
    """One conversation: its system prompt, its user messages and each turn's output cap."""

    system: str
    users: tuple[str, ...]
    max_tokens: tuple[int, ...]

    def turn(self, t: int, answers: list[str]) -> WorkItem:
        """Turn `t` (from 0), given the answers to the turns before it."""
        if len(answers) != t:
            raise ValueError(f"turn {t} needs {t} earlier answers, got {len(answers)}")
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for user, answer in zip(self.users[:t], answers, strict=True):
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": answer},
            ]
        messages.append({"role": "user", "content": self.users[t]})
        return WorkItem(max_tokens=self.max_tokens[t], messages=tuple(messages))


@dataclass(frozen=True)
class ConversationWorkload:
    system_len: int
    user_len: int
    output_len: int
    turns: int
    think_time_s: float = 0.0
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.turns < 1 or self.user_len < 1 or self.output_len < 1 or self.system_len < 0:
            raise ValueError("--turns, --input-len, --output-len >= 1 and --prefix-len >= 0")
        if self.think_time_s < 0:
            raise ValueError(f"--think-time-s must be >= 0, got {self.think_time_s}")
        RandomWorkload(self.user_len, self.output_len, self.range_ratio)  # checks the ratio

    def sessions(self, seed: int, tokenizer: TokenCounter | None = None) -> Iterator[Session]:
        rng = random.Random(seed)
        system = _prompt(random.Random(f"system-{seed}"), self.system_len, tokenizer)
        while True:
            ratio = self.range_ratio
            lengths = [
                (_draw(rng, self.user_len, ratio), _draw(rng, self.output_len, ratio))
                for _ in range(self.turns)
            ]
            users = tuple(_prompt(rng, n_in, tokenizer) for n_in, _ in lengths)
            yield Session(system, users, tuple(n_out for _, n_out in lengths))


def _draw(rng: random.Random, length: int, ratio: float) -> int:
    low = max(1, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return rng.randint(low, high)


def _prompt(rng: random.Random, n_tokens: int, tokenizer: TokenCounter | None) -> str:
    words = rng.choices(WORDS, k=n_tokens)
    if tokenizer is None:
        return " ".join(words)
    ids = tokenizer.encode(" ".join(words))
    while len(ids) < n_tokens:  # only if a word ever encoded to less than one token
        words += rng.choices(WORDS, k=n_tokens - len(ids))
        ids = tokenizer.encode(" ".join(words))
    return tokenizer.decode(ids[:n_tokens])


@dataclass(frozen=True)
class JsonlWorkload:
    items_in_file: tuple[WorkItem, ...]

    @classmethod
    def load(cls, path: Path, default_max_tokens: int) -> JsonlWorkload:
        items = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    items.append(_parse_line(line, default_max_tokens, f"{path}:{lineno}"))
        if not items:
            raise ValueError(f"{path}: no requests in the dataset")
        return cls(tuple(items))

    def items(self, seed: int) -> Iterator[WorkItem]:
        order = list(self.items_in_file)
        random.Random(seed).shuffle(order)
        while True:
            yield from order


def _parse_line(line: str, default_max_tokens: int, where: str) -> WorkItem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if isinstance(prompt, str) and prompt and messages is None:
        return WorkItem(max_tokens=max_tokens, prompt=prompt)
    if isinstance(messages, list) and messages and prompt is None:
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{where}: each message must be an object with a role")
        return WorkItem(max_tokens=max_tokens, messages=tuple(messages))
    raise ValueError(f'{where}: needs exactly one of a non-empty "prompt" or "messages"')


def request_body(
    item: WorkItem,
    endpoint: str,
    model: str,
    temperature: float,
    ignore_eos: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The JSON body of one streaming request. `max_tokens` with `ignore_eos` (a vLLM-style
    field pdserve accepts) asks for exactly that many output tokens."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": item.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = item.chat_messages()
    elif item.prompt is not None:
        body["prompt"] = item.prompt
    else:
        raise ValueError('a "messages" dataset line needs --endpoint chat')
    return {**body, **extra}
