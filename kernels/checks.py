"""Argument checks for the Triton wrappers: a clear ValueError instead of a wrong result.

Only shapes, dtypes, devices and strides are checked: nothing here reads tensor
values, so a check never synchronizes with the GPU. Values (slots, block ids,
context lengths) are the caller's contract, stated in each kernel's docstring.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    unit_last_stride: bool = True,
) -> None:
    """`t` has `ndim` dims, one of `dtypes`, lives on `device`, and (by default) its
    last dim is contiguous, which every kernel's vector loads rely on."""
    require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name} must be one of {dtypes}, got {t.dtype}")
    require(t.device == device, f"{name} is on {t.device}, expected {device}")
    if unit_last_stride and t.shape[-1] > 1:
        require(t.stride(-1) == 1, f"{name} must have stride 1 in its last dim, got {t.stride()}")


def check_cache(kv_cache: torch.Tensor, layer: int | None = None) -> None:
    """kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    require(
        kv_cache.dim() == 6 and kv_cache.shape[2] == 2,
        "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
        f"got shape {tuple(kv_cache.shape)}",
    )
    check_tensor("kv_cache", kv_cache, 6, FLOAT_DTYPES, kv_cache.device)
    if layer is not None:
        num_layers = kv_cache.shape[1]
        require(0 <= layer < num_layers, f"layer {layer} out of range [0, {num_layers})")


def check_heads(num_heads: int, num_kv_heads: int, head_dim: int, cache_head_dim: int) -> None:
    require(
        head_dim == cache_head_dim,
        f"query head_dim {head_dim} != the cache's head_dim {cache_head_dim}",
    )
    require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}",
    )
