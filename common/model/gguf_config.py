"""Rebuild ``config.json`` and ``generation_config.json`` from a GGUF file's metadata.

The metadata is a plain ``dict`` (key -> decoded value, see ``read_metadata``) under llama.cpp's
key names (``<arch>.block_count``, ``tokenizer.ggml.eos_token_id``, ...).  Architectures other than
those in ``ARCHS`` raise ``GGUFError`` naming what the file states.

Imports only third-party packages (gguf, numpy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader


class GGUFError(ValueError):
    """A GGUF file that cannot be converted (unsupported architecture, quantization type,
    tokenizer or tensor, or malformed metadata).  The message names what the file states."""


@dataclass(frozen=True)
class Arch:
    hf_class: str
    model_type: str
    permute_qk: bool  # llama.cpp permuted the q/k rows for its interleaved RoPE


ARCHS = {
    "llama": Arch("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", permute_qk=False),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHS)

_LLAMA3_ROPE: dict[str, float] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata field of the file, decoded (strings as str, arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def arch_of(meta: Mapping[str, Any]) -> Arch:
    name = meta.get("general.architecture")
    if name not in ARCHS:
        raise GGUFError(
            f"GGUF architecture {name!r} is not supported; supported: {', '.join(ARCHS)}"
        )
    return ARCHS[name]


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _int_field(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, (int, np.integer)):
        raise GGUFError(f"GGUF metadata {key!r} must be an integer, found {value!r}")
    return int(value)


def _rope_scaling(meta: Mapping[str, Any], arch: str, freqs: np.ndarray | None) -> dict | None:
    """HF ``rope_scaling`` from ``<arch>.rope.scaling.*`` or llama-3's ``rope_freqs`` tensor."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor:
        orig = _int_field(meta, f"{arch}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": _f32(factor),
            "original_max_position_embeddings": orig,
        }
    if kind not in (None, "none"):
        raise GGUFError(f"GGUF RoPE scaling type {kind!r} is not supported")
    return None if freqs is None else _llama3_rope_scaling(meta, arch, freqs)


def _llama3_rope_scaling(meta: Mapping[str, Any], arch: str, freqs: np.ndarray) -> dict:
    """llama.cpp stores llama-3 RoPE scaling as per-frequency divisors (``rope_freqs``).

    Recognised when they equal the llama-3 formula with Llama 3.x's constants and factor
    ``max(freqs)``; anything else raises GGUFError rather than guess.
    """
    head_dim = 2 * freqs.size
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    factor = _f32(freqs.max())
    low, high = _LLAMA3_ROPE["low_freq_factor"], _LLAMA3_ROPE["high_freq_factor"]
    orig = _LLAMA3_ROPE["original_max_position_embeddings"]
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((orig * inv / (2 * np.pi) - low) / (high - low), 0.0, 1.0)
    expected = 1.0 / ((1 - smooth) / factor + smooth)
    if not np.allclose(freqs, expected, rtol=1e-3):
        raise GGUFError("GGUF rope_freqs tensor does not match llama-3 RoPE scaling")
    return {"rope_type": "llama3", "factor": factor, **_LLAMA3_ROPE}


def build_config(
    meta: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    dtype: str,
    rope_freqs: np.ndarray | None = None,
) -> dict[str, Any]:
    """``config.json`` for the file: ``shapes`` maps GGUF tensor names to row-major shapes."""
    arch = arch_of(meta)
    key = meta["general.architecture"]
    heads = _int_field(meta, f"{key}.attention.head_count")
    hidden = _int_field(meta, f"{key}.embedding_length")
    head_dim = meta.get(f"{key}.attention.key_length") or meta.get(f"{key}.rope.dimension_count")
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": _int_field(meta, f"{key}.feed_forward_length"),
        "num_hidden_layers": _int_field(meta, f"{key}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int_field(meta, f"{key}.attention.head_count_kv", heads),
        "head_dim": int(head_dim or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.get(f"{key}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta.get(f"{key}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _int_field(meta, f"{key}.context_length", 2048),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "torch_dtype": dtype,
    }
    for name, gguf_name in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    if (scaling := _rope_scaling(meta, key, rope_freqs)) is not None:
        config["rope_scaling"] = scaling
    return config


def build_generation_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``generation_config.json``: BOS/pad and every end-of-generation id the file names
    (``eos``, plus ``eot``/``eom`` when present), as llama.cpp stops on all of them."""
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    config: dict[str, Any] = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return config
