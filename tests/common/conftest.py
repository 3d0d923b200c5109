"""Tiny random transformers checkpoints for the engine and model tests (test_engine_hf,
test_engine_scheduling, test_sampling)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# Small, well-conditioned random models: initializer_range 0.1 keeps the logits
# of different tokens far apart, so float32 greedy decoding is reproducible
# across implementations.
_HF_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)
_HF_ARCHS: dict[str, tuple[str, dict]] = {
    # Untied, Llama-3 RoPE scaling (the scaled band matters at these head dims
    # and context lengths), non-default rope_theta, full multi-head attention.
    "llama": (
        "LlamaForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        ),
    ),
    # q/k/v bias (made nonzero below), tied embeddings.
    "qwen2": (
        "Qwen2ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # Grouped-query attention: 8 query heads share 2 KV heads.
    "mistral": (
        "MistralForCausalLM",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
}


@dataclass(frozen=True)
class HFCheckpoint:
    path: Path
    model: Any  # the transformers model (float32, eval mode) the checkpoint holds


def _random_hf_model(arch: str) -> Any:
    import transformers

    cls_name, overrides = _HF_ARCHS[arch]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**_HF_COMMON, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = cls(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):  # HF initializes biases to zero
                    p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., HFCheckpoint]:
    """Factory: `hf_checkpoint(arch, max_shard_size=None)` saves a random checkpoint.

    arch is "llama", "qwen2" or "mistral"; results are cached for the session, and
    the same arch always holds the same weights (sharded or not). Read-only.
    """
    models: dict[str, Any] = {}
    saved: dict[tuple[str, str | None], HFCheckpoint] = {}

    def build(arch: str, max_shard_size: str | None = None) -> HFCheckpoint:
        key = (arch, max_shard_size)
        if key not in saved:
            if arch not in models:
                models[arch] = _random_hf_model(arch)
            path = tmp_path_factory.mktemp(f"hf-{arch}")
            kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
            models[arch].save_pretrained(path, **kwargs)
            saved[key] = HFCheckpoint(path, models[arch])
        return saved[key]

    return build
