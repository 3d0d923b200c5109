"""The engine's paged KV cache: its dtype (the model's, or another: `kv_cache_dtype`), shape
and size, allocated on the engine's device.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

A cache in another dtype than the model's is cast on write and read back in the model's
dtype by the torch kernels; the Triton kernels take one dtype for both.
"""

from __future__ import annotations

import torch

from common.engine.config import EngineConfig
from common.model.config import ModelConfig


def allocate_kv_cache(
    config: EngineConfig, mc: ModelConfig, model_dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed cache in `config.kv_cache_dtype` (auto: `model_dtype`) of `config.num_blocks`
    blocks, or as many as `config.kv_cache_memory` bytes hold (at least one)."""
    name = config.kv_cache_dtype
    dtype = model_dtype if name == "auto" else getattr(torch, name)
    block_shape = (mc.num_layers, 2, config.block_size, mc.num_kv_heads, mc.head_dim)
    block_bytes = torch.Size(block_shape).numel() * dtype.itemsize
    num_blocks = config.num_blocks or max(1, config.kv_cache_memory // block_bytes)
    return torch.zeros((num_blocks, *block_shape), dtype=dtype, device=device)


def check_kernels(kernels: str, kv: torch.dtype, model_dtype: torch.dtype) -> None:
    """ValueError if kernels `kernels` cannot read and write a `kv` cache under a model of
    `model_dtype`."""
    if kv != model_dtype and kernels != "torch":
        raise ValueError(
            f"a {kv} KV cache under a {model_dtype} model needs the torch kernels "
            f"(the {kernels} kernels read and write the model's dtype only)"
        )
