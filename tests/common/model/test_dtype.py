"""Which dtype a model runs in: `auto` keeps the checkpoint's, except where the CPU would
emulate it (float16 anywhere on the CPU, bfloat16 on a CPU without bfloat16 arithmetic)."""

from __future__ import annotations

import dataclasses
import logging
import platform
from pathlib import Path

import pytest
import torch

from common.model import weights
from common.model.config import ModelConfig, ModelLoadError
from common.model.weights import cpu_computes_bfloat16, resolve_dtype

CFG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    tie_word_embeddings=False,
    attention_bias=False,
    torch_dtype="bfloat16",
    eos_token_ids=(2,),
    bos_token_id=1,
)


def _cpu(monkeypatch: pytest.MonkeyPatch, computes_bf16: bool | None) -> None:
    monkeypatch.setattr(weights, "cpu_computes_bfloat16", lambda: computes_bf16)


def test_auto_runs_a_bfloat16_checkpoint_in_float32_on_a_cpu_without_bfloat16_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _cpu(monkeypatch, False)
    with caplog.at_level(logging.WARNING, logger=weights.__name__):
        assert resolve_dtype(CFG, "auto", "cpu") == torch.float32
    assert "running it in float32" in caplog.text


@pytest.mark.parametrize("computes_bf16", [True, None], ids=["has-bf16", "cannot-tell"])
def test_auto_keeps_a_bfloat16_checkpoint_where_the_cpu_computes_it_or_cannot_tell(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, computes_bf16: bool | None
) -> None:
    _cpu(monkeypatch, computes_bf16)
    with caplog.at_level(logging.WARNING, logger=weights.__name__):
        assert resolve_dtype(CFG, "auto", "cpu") == torch.bfloat16
    assert caplog.text == ""


def test_the_cpu_check_is_for_the_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch, False)
    assert resolve_dtype(CFG, "auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype(CFG, "auto", "cuda") == torch.bfloat16


def test_an_explicit_bfloat16_is_kept_with_a_warning_on_a_cpu_without_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _cpu(monkeypatch, False)
    f32 = dataclasses.replace(CFG, torch_dtype="float32")
    with caplog.at_level(logging.WARNING, logger=weights.__name__):
        assert resolve_dtype(f32, "bfloat16", "cpu") == torch.bfloat16
    assert "emulates it" in caplog.text


@pytest.mark.parametrize(
    ("checkpoint", "asked", "want"),
    [
        ("float16", "auto", torch.float32),
        ("float32", "auto", torch.float32),
        ("bfloat16", "float32", torch.float32),
    ],
)
def test_other_dtypes(
    monkeypatch: pytest.MonkeyPatch, checkpoint: str, asked: str, want: torch.dtype
) -> None:
    _cpu(monkeypatch, True)
    assert resolve_dtype(dataclasses.replace(CFG, torch_dtype=checkpoint), asked, "cpu") == want


def test_an_unsupported_dtype_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        resolve_dtype(dataclasses.replace(CFG, torch_dtype="int8"), "auto", "cpu")


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64",
    reason="the kernel's CPU flags are read from Linux's /proc/cpuinfo on x86-64",
)
def test_the_bfloat16_probe_agrees_with_the_kernels_cpu_flags() -> None:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    assert cpu_computes_bfloat16() is bool({"avx512_bf16", "amx_bf16"} & flags)
