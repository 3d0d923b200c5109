"""Argument checks for the Triton wrappers: a clear ValueError instead of a wrong result.

Only shapes, dtypes, devices and strides are checked: nothing here reads tensor
values, so a check never synchronizes with the GPU. Values (slots, block ids,
context lengths) are the caller's contract, stated in each kernel's docstring. Each check
is a plain comparison whose message is formatted only when it fails: a step runs these for
every layer, so a passing check costs just the comparison.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


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
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if unit_last_stride and t.shape[-1] > 1:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim, got {t.stride()}")


def check_cache(kv_cache: torch.Tensor, layer: int | None = None) -> None:
    """kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    if not (kv_cache.dim() == 6 and kv_cache.shape[2] == 2):
        raise ValueError(
            "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    check_tensor("kv_cache", kv_cache, 6, FLOAT_DTYPES, kv_cache.device)
    if layer is not None:
        num_layers = kv_cache.shape[1]
        if not (0 <= layer < num_layers):
            raise ValueError(f"layer {layer} out of range [0, {num_layers})")


def check_heads(num_heads: int, num_kv_heads: int, head_dim: int, cache_head_dim: int) -> None:
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} != the cache's head_dim {cache_head_dim}")
    if not (num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
