"""Convert a llama.cpp GGUF file into a Hugging Face-style model directory.

``convert_gguf(path, out_dir)`` writes what a plain HF-directory loader reads:

- ``config.json`` (``LlamaForCausalLM`` or ``Qwen2ForCausalLM``) rebuilt from the ``<arch>.*``
  metadata;
- ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus an index when larger than
  ``max_shard_bytes``) with HF tensor names, every tensor dequantized to ``dtype``; the
  ``lm_head.weight`` only when the file has its own ``output.weight`` (else embeddings are tied);
- ``tokenizer.json`` / ``tokenizer_config.json`` (see ``gguf_tokenizer``) and
  ``generation_config.json``.

llama.cpp's converter stores the rows of Llama's q/k projections permuted (interleaved RoPE
pairs); they are un-permuted here so the weights match HF's rotate-half RoPE.  Qwen2 files are not
permuted.  Mistral checkpoints converted by llama.cpp state architecture ``llama`` and convert as
Llama.  Dequantization goes through the ``gguf`` package (vectorised numpy), for the types in
``SUPPORTED_QUANT_TYPES``; any other architecture or type raises ``GGUFError`` naming it before
anything is written.  The output appears atomically: it is built in a temporary directory beside
``out_dir`` and renamed into place, so a crash leaves no half-written model.

Imports only third-party packages (gguf, numpy, torch, safetensors, tokenizers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize as _gguf_dequantize
from safetensors.torch import save_file

from common.model.gguf_config import (
    ARCHS,
    SUPPORTED_ARCHITECTURES,
    Arch,
    GGUFError,
    arch_of,
    build_config,
    build_generation_config,
    read_metadata,
)
from common.model.gguf_tokenizer import build_tokenizer, build_tokenizer_config

__all__ = [
    "GGUFError",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_QUANT_TYPES",
    "convert_gguf",
    "dequantize_tensor",
    "read_metadata",
    "unpermute_rows",
]

_Q = GGMLQuantizationType
SUPPORTED_QUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1}
    | {_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K}
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 4 << 30


_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama-3 RoPE scaling, folded into config.json


def dequantize_tensor(
    data: np.ndarray, qtype: int, shape: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize raw GGUF tensor ``data`` of ggml type ``qtype`` to a ``dtype`` tensor of
    ``shape`` (row-major, i.e. the reverse of GGUF's ``ne``).  Vectorised (gguf.quants).

    Raises GGUFError naming the type when it is not in SUPPORTED_QUANT_TYPES.
    """
    qtype = GGMLQuantizationType(int(qtype))
    if qtype not in SUPPORTED_QUANT_TYPES:
        raise GGUFError(f"GGUF quantization type {qtype.name} is not supported")
    values = _gguf_dequantize(np.asarray(data), qtype).reshape(tuple(int(s) for s in shape))
    if not (values.flags.writeable and values.flags.c_contiguous):
        values = np.array(values, dtype=np.float32, order="C")
    return torch.from_numpy(values).to(dtype)


def unpermute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute(w, n_head)`` of a q/k projection weight or bias (rows).

    llama.cpp reorders each head's rows from rotate-half order [x0..x(d/2-1), y0..] to
    interleaved pairs [x0, y0, x1, y1, ...]; this restores HF's order.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {rows} rows into {n_head} heads")
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def hf_tensor_name(gguf_name: str) -> str:
    """The HF name of a llama.cpp tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); GGUFError for a tensor with no HF counterpart."""
    stem, _, kind = gguf_name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if kind in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{kind}"
        if layer and layer[2] in _LAYER_TENSORS:
            return f"model.layers.{layer[1]}.{_LAYER_TENSORS[layer[2]]}.{kind}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama/Qwen2 counterpart")


def _check_tensors(reader: GGUFReader) -> None:
    """Refuse, before any work, a tensor of an unsupported type or with no HF name."""
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise GGUFError(
                f"GGUF tensor {t.name!r} has quantization type {t.tensor_type.name}, which is not "
                f"supported (supported: {', '.join(sorted(q.name for q in SUPPORTED_QUANT_TYPES))})"
            )
        if t.name != _ROPE_FREQS:
            hf_tensor_name(t.name)


def _shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def _load(
    t: ReaderTensor, config: Mapping[str, Any], arch: Arch, dtype: torch.dtype
) -> torch.Tensor:
    """One tensor, dequantized to float32, un-permuted if it is a llama q/k, then cast."""
    tensor = dequantize_tensor(t.data, t.tensor_type, _shape(t), torch.float32)
    if arch.permute_qk and ".attn_q." in t.name:
        tensor = unpermute_rows(tensor, config["num_attention_heads"])
    elif arch.permute_qk and ".attn_k." in t.name:
        tensor = unpermute_rows(tensor, config["num_key_value_heads"])
    return tensor.to(dtype).contiguous()


def _plan_shards(
    tensors: Sequence[ReaderTensor], itemsize: int, limit: int
) -> list[list[ReaderTensor]]:
    """Group tensors, in file order, into shards of at most ``limit`` bytes (at least one each)."""
    shards: list[list[ReaderTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = int(t.n_elements) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _write_weights(
    reader: GGUFReader, config: Mapping[str, Any], dtype: torch.dtype, out: Path, limit: int
) -> None:
    """Write the safetensors file(s), one shard in memory at a time; an index when sharded."""
    arch = ARCHS[config["model_type"]]
    tensors = [t for t in reader.tensors if t.name != _ROPE_FREQS]
    shards = _plan_shards(tensors, dtype.itemsize, limit)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        )
        state = {hf_tensor_name(t.name): _load(t, config, arch, dtype) for t in shard}
        save_file(state, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, fname))
        total += sum(v.numel() * v.element_size() for v in state.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)


def _check_layers(config: Mapping[str, Any], names: set[str]) -> None:
    """Every layer must have all of its tensors (a truncated file fails here, not at load)."""
    wanted = [
        f"blk.{i}.{t}.weight" for i in range(config["num_hidden_layers"]) for t in _LAYER_TENSORS
    ]
    missing = [n for n in [*wanted, "token_embd.weight", "output_norm.weight"] if n not in names]
    if missing:
        raise GGUFError(f"GGUF file lacks tensors {missing[:4]} ({len(missing)} missing)")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def _staging_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A temp dir beside ``out_dir``, renamed to ``out_dir`` on success, removed on failure."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        _make_readable(tmp)
        _swap_in(tmp, out_dir, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(directory: Path) -> None:
    """mkdtemp makes 0700 and safetensors writes 0600: give the usual 0755 / 0644."""
    os.chmod(directory, 0o755)
    for f in directory.iterdir():
        os.chmod(f, 0o644)


def _swap_in(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out_dir``; with ``overwrite``, an existing ``out_dir`` is moved aside
    first and deleted after (restored if the rename fails)."""
    if not (overwrite and out_dir.exists()):
        os.rename(tmp, out_dir)  # fails if out_dir appeared meanwhile and is not empty
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / "model")
    try:
        os.rename(tmp, out_dir)
    except OSError:
        os.rename(old / "model", out_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _rope_freqs(t: ReaderTensor | None) -> np.ndarray | None:
    """The values of llama-3's ``rope_freqs`` tensor, if the file has one."""
    return None if t is None else dequantize_tensor(t.data, t.tensor_type, _shape(t)).numpy()


def _open(gguf_path: Path) -> GGUFReader:
    try:
        return GGUFReader(gguf_path, "r")
    except (ValueError, OSError) as e:
        raise GGUFError(f"{gguf_path} is not a readable GGUF file: {e}") from e


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert ``gguf_path`` into the HF model directory ``out_dir`` (see the module docstring).

    ``dtype``: "float32" (exact for every supported type) or "bfloat16".  Raises GGUFError for an
    unsupported architecture, quantization type, tokenizer or tensor, before writing anything;
    FileExistsError when ``out_dir`` exists and ``overwrite`` is False.  Returns ``out_dir``.
    """
    if dtype not in _DTYPES:
        raise GGUFError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists")
    reader = _open(gguf_path)
    meta = read_metadata(reader)
    arch_of(meta)
    _check_tensors(reader)
    by_name = {t.name: t for t in reader.tensors}
    shapes = {n: _shape(t) for n, t in by_name.items()}
    config = build_config(meta, shapes, dtype, _rope_freqs(by_name.get(_ROPE_FREQS)))
    _check_layers(config, set(by_name))
    tokenizer = build_tokenizer(meta)
    with _staging_dir(out_dir, overwrite) as tmp:
        _write_weights(reader, config, _DTYPES[dtype], tmp, max_shard_bytes)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(
            tmp / "tokenizer_config.json",
            build_tokenizer_config(meta, config["max_position_embeddings"]),
        )
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", build_generation_config(meta))
    return out_dir
