"""GGUF -> HF directory conversion, checked against transformers' own GGUF loading.

Reference: transformers loading the same .gguf with ``gguf_file=`` (tokenizer and model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.model import gguf as conv
from common.model.gguf import (
    SUPPORTED_QUANT_TYPES,
    GGUFError,
    convert_gguf,
    dequantize_tensor,
    unpermute_rows,
)
from common.model.gguf_config import build_config
from common.wire.sampling_params import SamplingParams
from tests.common.model.conftest import (
    TINY,
    TINY_QTYPES,
    Q,
    gguf,
    llama_cpp_permute,
    tiny_tokens,
    write_tiny_gguf,
)
from tests.support.schedule import TORCH_THREADS

transformers = pytest.importorskip("transformers")

# -- (a) tokenizer -------------------------------------------------------------------------------

TEXTS = [
    "Hello world",
    "Tell me a story about a fox.",
    "   leading spaces and trailing   ",
    "multiple     spaces    here",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines",
    "héllo wörld — ünïcödé “quotes” naïve café",
    "日本語のテキストと中文",
    "ΑΒΓ Ελληνικά и кириллица",
    "emoji 🦊🔥👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    'def f(x):\n    return {"k": x ** 2}  # comment\n',
    "I'm sure they'll say it's fine, won't they've?",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<filename>a.py<gh_stars>",
    "Version 3.14159, 1,000,000 and 2024-11-30",
    "a1b2c3 99bottles x86_64",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "\x00\x01 control \x7f bytes",
]
# Whitespace right before a digit: llama.cpp's "smollm" pre-tokenizer (and the original
# SmolLM2 tokenizer.json) split digits first, so "  1" is ["ĠĠ", "1"]; transformers' GGUF
# loader knows no "smollm" and uses plain GPT-2 splitting: ["Ġ", "Ġ", "1"].
DIGIT_TEXTS = ["x  1", "Year:\n\n2024", "foo\n 42", "  123", "a\t\t7"]


def _ours(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def _llama_cpp_reference(ref_tokenizer: Any) -> Tokenizer:
    """transformers' GGUF tokenizer with llama.cpp's "smollm" split (digits first)."""
    backend = Tokenizer.from_str(ref_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    return backend


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(
    text: str, smollm2_dir: Path, ref_tokenizer: Any, our_hf_tokenizer: Any
) -> None:
    expected = ref_tokenizer(text).input_ids
    ours = _ours(smollm2_dir).encode(text).ids
    assert ours == expected
    assert our_hf_tokenizer(text).input_ids == expected  # same file through transformers
    assert _ours(smollm2_dir).decode(ours, skip_special_tokens=False) == text
    assert ref_tokenizer.decode(expected) == text


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_tokenizer_splits_digits_like_llama_cpp(
    text: str, smollm2_dir: Path, ref_tokenizer: Any
) -> None:
    ours = _ours(smollm2_dir).encode(text).ids
    assert ours == _llama_cpp_reference(ref_tokenizer).encode(text).ids
    assert ours != ref_tokenizer(text).input_ids  # the known transformers difference
    assert _ours(smollm2_dir).decode(ours) == text


def test_tokenizer_special_tokens(smollm2_dir: Path, ref_tokenizer: Any) -> None:
    ours = _ours(smollm2_dir)
    assert ours.encode("<|im_start|>").ids == [1]
    assert ours.decode([1, 28, 2], skip_special_tokens=True) == ref_tokenizer.decode(
        [1, 28, 2], skip_special_tokens=True
    )
    cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["add_bos_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        False,
    )
    ref_added = ref_tokenizer.backend_tokenizer.get_added_tokens_decoder()
    expected = {i: (t.content, t.special) for i, t in ref_added.items()}
    assert {
        i: (t.content, t.special) for i, t in ours.get_added_tokens_decoder().items()
    } == expected
    assert len(expected) == 17


@pytest.mark.parametrize("system", [False, True])
def test_chat_template_renders_identically(
    system: bool, ref_tokenizer: Any, our_hf_tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "Tell me a story about a fox."}]
    if system:
        messages = [{"role": "system", "content": "Be terse."}, *messages]
        messages += [{"role": "assistant", "content": "Once."}, {"role": "user", "content": "More"}]
    for gen in (True, False):
        kw = {"tokenize": False, "add_generation_prompt": gen}
        assert our_hf_tokenizer.apply_chat_template(
            messages, **kw
        ) == ref_tokenizer.apply_chat_template(messages, **kw)


# -- (b) greedy parity ---------------------------------------------------------------------------

CHAT_PROMPTS = ["Tell me a story about a fox.", "What is the capital of France?"]
PLAIN_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n"]


def _prompt_ids(ref_tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    if chat:
        text = ref_tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    return torch.tensor([ref_tokenizer(text).input_ids])


def _generate(model: Any, prompt_ids: list[int]) -> list[int]:
    """32 greedy tokens after `prompt_ids` (transformers' `generate`)."""
    x = torch.tensor([prompt_ids])
    kw = {"max_new_tokens": 32, "do_sample": False, "attention_mask": torch.ones_like(x)}
    return model.generate(x, **kw)[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def ref_generations(ref_tokenizer: Any, ref_model: Any) -> dict[tuple[str, bool], list[int]]:
    """transformers' greedy tokens from the .gguf itself, per (prompt, chat): the reference
    both generation tests compare against, computed once."""
    out = {}
    with torch.inference_mode():
        for prompt, chat in [(p, True) for p in CHAT_PROMPTS] + [(p, False) for p in PLAIN_PROMPTS]:
            out[prompt, chat] = _generate(
                ref_model, _prompt_ids(ref_tokenizer, prompt, chat)[0].tolist()
            )
    return out


def test_converted_weights_equal_transformers(smollm2_dir: Path, ref_model: Any) -> None:
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    ref = ref_model.state_dict()
    assert "lm_head.weight" not in ours  # tied embeddings
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.parametrize(
    ("prompt", "chat"), [(p, True) for p in CHAT_PROMPTS] + [(p, False) for p in PLAIN_PROMPTS]
)
def test_greedy_generation_matches_transformers_gguf(
    prompt: str, chat: bool, ref_tokenizer: Any, ref_generations: Any, our_model: Any
) -> None:
    assert type(our_model).__name__ == "LlamaForCausalLM"
    ids = _prompt_ids(ref_tokenizer, prompt, chat)
    with torch.inference_mode():
        got = _generate(our_model, ids[0].tolist())
    assert got == ref_generations[prompt, chat]
    assert len(got) > 4, "generated almost nothing"


def test_pdserve_engine_matches_transformers_gguf(
    smollm2_dir: Path, ref_tokenizer: Any, ref_generations: Any
) -> None:
    """pdserve's engine on the converted directory, all prompts in one batch, greedy: token
    for token what transformers generates from the .gguf itself."""
    prompts = [(p, True) for p in CHAT_PROMPTS] + [(p, False) for p in PLAIN_PROMPTS]
    ids = [_prompt_ids(ref_tokenizer, p, chat)[0].tolist() for p, chat in prompts]
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), num_blocks=256, threads=TORCH_THREADS))
    sampling = SamplingParams(temperature=0.0, max_tokens=32)
    got = engine.generate(ids, sampling)
    engine.check_integrity()
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.token_ids == ref_generations[prompt], completion.prompt_token_ids
        assert len(completion.token_ids) > 4, "generated almost nothing"


# -- (c) dequantization --------------------------------------------------------------------------

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Q4_0 steps of 1/8 of the block max (|x| <= 3 here), etc.
ROUNDTRIP_ATOL = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.02}


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_dequantize_synthetic(qtype: Any) -> None:
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((8, 96)).astype(np.float32)
    data = gguf.quants.quantize(values, qtype)
    reference = gguf.quants.dequantize(data, qtype).reshape(8, 96)
    got = dequantize_tensor(data, qtype, (8, 96))
    assert got.dtype == torch.float32 and got.shape == (8, 96)
    assert torch.equal(got, torch.from_numpy(reference))
    atol = ROUNDTRIP_ATOL.get(qtype, 0.45)
    np.testing.assert_allclose(got.numpy(), values, atol=atol, rtol=0)
    bf16 = dequantize_tensor(data, qtype, (8, 96), torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(reference).to(torch.bfloat16))


_K_HALVES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@pytest.mark.parametrize("qtype", list(_K_HALVES), ids=lambda q: q.name)
def test_dequantize_k_quants_against_transformers(qtype: Any) -> None:
    """gguf cannot quantize K types; random blocks with sane fp16 scales, checked against
    transformers' independent torch implementation."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(int(qtype))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (12, size), dtype=np.uint8)
    for off in _K_HALVES[qtype]:
        halves = (rng.standard_normal(12) * 0.01).astype(np.float16)
        blocks[:, off : off + 2] = halves.view(np.uint8).reshape(12, 2)
    data = blocks.reshape(3, 4 * size)  # 3 rows of 4 blocks
    got = dequantize_tensor(data, qtype, (3, 4 * block))
    expected = hf_dequantize(torch.from_numpy(blocks.reshape(-1)), int(qtype)).reshape(3, -1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_dequantize_real_tensors(smollm2_gguf: Path) -> None:
    reader = gguf.GGUFReader(smollm2_gguf)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        shape = tuple(reversed(t.shape.tolist()))
        rows = t.data[:64] if len(shape) == 2 else t.data  # the first rows are enough
        shape = (rows.shape[0], shape[1]) if len(shape) == 2 else shape
        got = dequantize_tensor(rows, t.tensor_type, shape)
        reference = gguf.quants.dequantize(rows, t.tensor_type).reshape(shape)
        assert torch.equal(got, torch.from_numpy(np.array(reference))), t.name
    assert seen == {Q.Q8_0, Q.Q4_1, Q.F32}


def test_unsupported_quant_type_is_refused() -> None:
    assert Q.IQ2_XXS not in SUPPORTED_QUANT_TYPES
    with pytest.raises(GGUFError, match="IQ2_XXS"):
        dequantize_tensor(np.zeros((1, 66), np.uint8), Q.IQ2_XXS, (1, 256))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for heads, rows in ((9, 576), (3, 192), (4, 64)):
        w = rng.standard_normal((rows, 32)).astype(np.float32)
        for x in (w, w[:, 0]):  # weight and bias
            permuted = torch.from_numpy(np.ascontiguousarray(llama_cpp_permute(x, heads)))
            assert torch.equal(unpermute_rows(permuted, heads), torch.from_numpy(x))


# -- synthetic files: architectures, types, refusals, atomicity -----------------------------------


def _hf_logits(model_dir: Path, gguf_file: str | None = None) -> torch.Tensor:
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, **kw
    )
    ids = torch.tensor([[5, 70, 200, 256, 260, 3, 99, 100, 101, 33]])
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False)]
)
def test_tiny_model_matches_transformers(arch: str, tied: bool, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, tied=tied)
    out = convert_gguf(path, tmp_path / "hf", max_shard_bytes=60_000)  # forces sharding
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ]
    assert cfg["tie_word_embeddings"] is tied
    assert (out / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(
        _hf_logits(out), _hf_logits(tmp_path, "tiny.gguf"), rtol=0, atol=1e-5
    )


def test_tiny_bfloat16(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    f32 = load_file(str(convert_gguf(path, tmp_path / "f32") / "model.safetensors"))
    bf16 = load_file(str(convert_gguf(path, tmp_path / "bf16", "bfloat16") / "model.safetensors"))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[k], v.to(torch.bfloat16)) for k, v in f32.items())


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_tiny_tokenizer_pre_types_match_transformers(pre: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre)
    ours = Tokenizer.from_file(str(convert_gguf(path, tmp_path / "hf") / "tokenizer.json"))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in [*TEXTS, *DIGIT_TEXTS, "the thin<think>in the\n\n 123456 the"]:
        assert ours.encode(text).ids == ref(text).input_ids, text


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma2")
    with pytest.raises(GGUFError, match="'gemma2'"):
        convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.gguf"]


def test_unsupported_tensor_type_is_refused(tmp_path: Path) -> None:
    qtypes = {**TINY_QTYPES, "ffn_up": Q.IQ4_NL}
    path = write_tiny_gguf(tmp_path / "t.gguf", qtypes=qtypes)
    with pytest.raises(GGUFError, match="IQ4_NL"):
        convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    extra = [("blk.0.attn_q_norm.weight", np.ones(16, np.float32), Q.F32)]
    path = write_tiny_gguf(tmp_path / "t.gguf", extra=extra)
    with pytest.raises(GGUFError, match="attn_q_norm"):
        convert_gguf(path, tmp_path / "out")


def test_crash_leaves_nothing_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf")
    calls = []

    def failing_save(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise OSError("disk full")

    monkeypatch.setattr(conv, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(path, tmp_path / "out")
    assert calls and sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]


def test_existing_output_needs_overwrite(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf")
    out = convert_gguf(path, tmp_path / "out")
    with pytest.raises(FileExistsError):
        convert_gguf(path, out)
    (out / "stale.txt").write_text("x")
    convert_gguf(path, out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.gguf"]
    assert oct(out.stat().st_mode & 0o777) == "0o755"


def _llama3_freqs(factor: float, head_dim: int = 64, theta: float = 500000.0) -> np.ndarray:
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv
    smooth = np.clip((8192 / wavelen - 1) / 3, 0, 1)
    return (1 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def test_rope_scaling() -> None:
    meta = {
        "general.architecture": "llama",
        "llama.attention.head_count": 2,
        "llama.embedding_length": 128,
        "llama.feed_forward_length": 256,
        "llama.block_count": 1,
        "llama.rope.freq_base": 500000.0,
    }
    shapes = {"token_embd.weight": (10, 128)}
    cfg = build_config(meta, shapes, "float32", _llama3_freqs(8.0))
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with pytest.raises(GGUFError, match="rope_freqs"):
        build_config(meta, shapes, "float32", np.linspace(1, 3, 32, dtype=np.float32))
    linear = {**meta, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    assert build_config(linear, shapes, "float32")["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    assert "rope_scaling" not in build_config(meta, shapes, "float32")


def test_tiny_config(tmp_path: Path) -> None:
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf"), tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_attention_heads"] == TINY["heads"] and cfg["head_dim"] == 16
    tokens, _ = tiny_tokens()
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["vocab_size"] == len(tokens) == 265
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": tokens.index("<|im_start|>"), "eos_token_id": 263}
