"""Tokenizer: round trips, chat template parity with transformers, EOS/BOS resolution, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.text.tokenizer import ChatTemplateError, Tokenizer

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Héllo 你好 😀 — ça va?\n  indented"},
        {"role": "assistant", "content": "Fine, thanks. <s> is just text here"},
        {"role": "user", "content": ""},
    ],
    [{"role": "user", "content": "tool?", "tool_calls": None}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))


def tokenizer_dir(src: Path, dst: Path, **configs: dict[str, Any]) -> Path:
    """A model dir with ``src``'s tokenizer.json and the given JSON files (name without .json)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    for name, obj in configs.items():
        (dst / f"{name}.json").write_text(json.dumps(obj), "utf-8")
    return dst


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=64))
def test_round_trip_arbitrary_unicode(tiny_tokenizer: Tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_encode_adds_bos(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.bos_token_id == 1
    assert tiny_tokenizer.encode("hi")[0] == 1
    assert tiny_tokenizer.encode("hi", add_special_tokens=False)[0] != 1
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("hi")) == "hi"


def test_specials_and_eos(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.eos_token_ids == [2, 4]
    assert tiny_tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4]) == [
        "<unk>",
        "<s>",
        "</s>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert tiny_tokenizer.special_token_ids == frozenset(range(5))
    assert tiny_tokenizer.byte_fallback_ids == frozenset()
    assert tiny_tokenizer.vocab_size == 2816


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tiny_tokenizer: Tokenizer,
    hf_tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    ours = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<s><|im_start|>")
    encoded = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    hf_ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
    ids = tiny_tokenizer.encode_chat(messages, add_generation_prompt)
    assert ids == hf_ids
    assert ids[0] == tiny_tokenizer.bos_token_id != ids[1]  # the template's BOS, not doubled


def test_encode_decode_match_transformers(tiny_tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    text = "The lighthouse keeper — 灯台守 — said «bonjour» 👋\n\tdef f(x): return x ** 2"
    ids = tiny_tokenizer.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert tiny_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_template_rejects_non_string_content(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="string message content"):
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text"}]}])


def test_template_errors_are_chat_template_errors(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):
        tiny_tokenizer.apply_chat_template([{"content": "no role"}])  # str + undefined
    with pytest.raises(ChatTemplateError):
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": None}])


def test_template_features(tiny_model_dir: Path, tmp_path: Path) -> None:
    """transformers' extras: loopcontrols, non-escaping tojson, {% generation %}, list form."""
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
    )
    cfg = {
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": template},
        ]
    }
    tok = Tokenizer.from_dir(tokenizer_dir(tiny_model_dir, tmp_path, tokenizer_config=cfg))
    msgs = [{"role": "user", "content": "<é>"}] * 3
    # trim_blocks drops the newline right after the endgeneration tag.
    assert tok.apply_chat_template(msgs) == '{"role": "user", "content": "<é>"}' * 2


def test_chat_template_jinja_file_wins(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = tokenizer_dir(tiny_model_dir, tmp_path, tokenizer_config={"chat_template": "config"})
    (d / "chat_template.jinja").write_text("file", "utf-8")
    assert Tokenizer.from_dir(d).apply_chat_template([]) == "file"


def test_no_chat_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(tokenizer_dir(tiny_model_dir, tmp_path))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        ({"generation_config": {"eos_token_id": 4}, "config": {"eos_token_id": [2]}}, [4]),
        ({"generation_config": {}, "config": {"eos_token_id": [2, 4]}}, [2, 4]),
        ({"config": {"eos_token_id": None}, "tokenizer_config": {"eos_token": "</s>"}}, [2]),
        (
            {"tokenizer_config": {"eos_token": {"content": "<|im_end|>", "special": True}}},
            [4],
        ),
        ({}, []),
    ],
)
def test_eos_resolution_order(
    tiny_model_dir: Path, tmp_path: Path, configs: dict[str, Any], expected: list[int]
) -> None:
    tok = Tokenizer.from_dir(tokenizer_dir(tiny_model_dir, tmp_path, **configs))
    assert tok.eos_token_ids == expected


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}", "utf-8")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_malformed_config_names_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = tokenizer_dir(tiny_model_dir, tmp_path)
    (d / "generation_config.json").write_text("{not json", "utf-8")
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_dir(d)
