"""Rebuild an HF fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``) from GGUF metadata.

A GGUF file carries its tokenizer as metadata under llama.cpp's keys (``tokenizer.ggml.*``): the
vocabulary, the BPE merges, a type per token, the special token ids, the ``add_bos``/``add_eos``
flags, a pre-tokenizer name (``tokenizer.ggml.pre``) and the chat template.  This module turns
that metadata (a plain ``dict`` of key -> decoded value) into a ``tokenizers.Tokenizer`` built the
way transformers builds one from the same file (``transformers.integrations.gguf``), with one
deliberate difference: the pre-tokenizer follows llama.cpp for the ``tokenizer.ggml.pre`` names
listed in ``_DIGIT_SPLIT_PRE`` (``smollm``, ``starcoder``, ...), which split every digit on its
own before the GPT-2 regex, as the original ``tokenizer.json`` of those models does; transformers
falls back to the plain GPT-2 split for them.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: GPT-2, SmolLM, Llama 3,
Qwen2, ...) are supported; anything else raises ``GGUFError`` naming what the file states.

Imports only third-party packages (``tokenizers``), so it can live anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from common.model.gguf_config import GGUFError
from common.wire.byte_level import byte_alphabet

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp pre-tokenizers that split every digit first, then apply the GPT-2 regex.
_DIGIT_SPLIT_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer name -> the split regex applied before the byte-level mapping.
_REGEX_SPLIT_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def _byte_level_vocab(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id, re-spelling in the byte alphabet any token the file stores as raw text."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return vocab


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    raw = meta.get("tokenizer.ggml.merges")
    if not raw:
        raise GGUFError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    pairs: list[tuple[str, str]] = []
    for merge in raw:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))
    return pairs


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for ``tokenizer.ggml.pre``; GPT-2's for unknown names."""
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _added_tokens(meta: Mapping[str, Any], vocab: Mapping[str, int]) -> list[AddedToken]:
    """Control tokens (special) and user-defined tokens (not special), matched whole in text.

    As transformers does, a control token spelled outside the byte alphabet is a llama.cpp
    mislabel and is skipped, and a user-defined one must be in the vocabulary as spelled.
    """
    alphabet = set(byte_alphabet().values())
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or ()
    added = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    added += [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and t in vocab
    ]
    return added


def _special_token(meta: Mapping[str, Any], key: str) -> tuple[str, int] | None:
    """(text, id) of ``tokenizer.ggml.<key>``, or None when absent or out of range."""
    tokens = meta["tokenizer.ggml.tokens"]
    token_id = meta.get(f"tokenizer.ggml.{key}")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)], int(token_id)


def _post_processor(meta: Mapping[str, Any]) -> processors.TemplateProcessing:
    """Prepend BOS / append EOS when the file's add_bos_token / add_eos_token say so."""
    bos = _special_token(meta, "bos_token_id") if meta.get("tokenizer.ggml.add_bos_token") else None
    eos = _special_token(meta, "eos_token_id") if meta.get("tokenizer.ggml.add_eos_token") else None
    pre = [f"{bos[0]}:0"] if bos else []
    post = [f"{eos[0]}:0"] if eos else []
    return processors.TemplateProcessing(
        single=" ".join([*pre, "$A:0", *post]),
        pair=" ".join([*pre, "$A:0", *post, *pre, "$B:1", *post]),
        special_tokens=[t for t in (bos, eos) if t is not None],
    )


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` described by GGUF metadata ``meta`` (key -> decoded value).

    Raises GGUFError for a tokenizer model other than byte-level BPE ("gpt2") or missing merges.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is"
        )
    if not meta.get("tokenizer.ggml.tokens"):
        raise GGUFError("GGUF file has no tokenizer.ggml.tokens")
    vocab = _byte_level_vocab(meta["tokenizer.ggml.tokens"])
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges(meta),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta)
    tokenizer.add_special_tokens(_added_tokens(meta, vocab))
    return tokenizer


def build_tokenizer_config(meta: Mapping[str, Any], max_length: int | None) -> dict[str, Any]:
    """``tokenizer_config.json``: special token strings, add_bos/eos flags and the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token = _special_token(meta, f"{key}_token_id")
        if token is not None:
            config[f"{name}_token"] = token[0]
    if max_length:
        config["model_max_length"] = int(max_length)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
