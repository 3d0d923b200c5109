"""Triton KV-cache movement: store new tokens into their slots, pack/unpack blocks.

Same contracts as kernels.reference.store_kv / pack_blocks / unpack_blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_cache, check_tensor
from kernels.triton_utils import check_launchable

_CHUNK = 4096  # elements one pack/unpack program copies
_MAX_GRID_Y = 65535  # CUDA's limit on grid dim 1


@triton.jit(do_not_specialize=["layer"])
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    slots_ptr,  # [num_tokens]; negative: padding, skipped
    layer,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cl,
    stride_ckv,
    stride_ct,
    stride_ch,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A negative slot is padding. (Compared as a tile: the interpreter mistypes a
    # scalar bool broadcast against a tile.)
    live = (tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot) >= 0
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :] & live
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * stride_cb
        + layer * stride_cl
        + (slot % BLOCK_SIZE) * stride_ct
        + offs_h[:, None] * stride_ch
        + offs_d[None, :]
    )
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_ckv, v, mask=mask)


def store_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V into their slots; negative slots are skipped.

    k, v: [num_tokens, num_kv_heads, head_dim] (a float dtype; cast to the
    cache's); slot_mapping: [num_tokens] int32/int64, each slot negative or below
    num_blocks * block_size, the non-negative ones distinct.
    """
    check_cache(kv_cache, layer)
    _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, FLOAT_DTYPES, kv_cache.device)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}"
            )
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, kv_cache.device, False)
    num_tokens = slot_mapping.shape[0]
    if not (k.shape[0] == num_tokens and v.shape[0] == num_tokens):
        raise ValueError(
            f"slot_mapping has {num_tokens} slots but k has {k.shape[0]} and v {v.shape[0]} rows"
        )
    check_launchable(kv_cache, k, v, slot_mapping)
    if num_tokens == 0:
        return
    # Cast here, as the reference does (torch rounds to nearest even), so that the
    # kernel only copies. The engine's k/v already have the cache's dtype.
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    sc = kv_cache.stride()
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, layer,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        sc[0], sc[1], sc[2], sc[3], sc[4],
        KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # contiguous [num_blocks, *block]
    staging_ptr,  # contiguous [>= n, *block]
    ids_ptr,  # [n] block ids
    block_numel,
    PACK: tl.constexpr,  # cache -> staging; else staging -> cache
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    block = tl.load(ids_ptr + i).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    in_cache = cache_ptr + block * block_numel + offs
    in_staging = staging_ptr + i.to(tl.int64) * block_numel + offs
    if PACK:
        tl.store(in_staging, tl.load(in_cache, mask=mask), mask=mask)
    else:
        tl.store(in_cache, tl.load(in_staging, mask=mask), mask=mask)


def _check_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    check_cache(kv_cache)
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (one block, one region)")
    check_tensor("block_ids", block_ids, 1, INDEX_DTYPES, kv_cache.device, False)
    check_tensor("staging", staging, kv_cache.dim(), (kv_cache.dtype,), kv_cache.device)
    if not staging.is_contiguous():
        raise ValueError("the staging buffer must be contiguous")
    if not (
        tuple(staging.shape[1:]) == tuple(kv_cache.shape[1:])
        and staging.shape[0] >= block_ids.shape[0]
    ):
        raise ValueError(
            f"staging must be [>= {block_ids.shape[0]}, *{tuple(kv_cache.shape[1:])}], "
            f"got {tuple(staging.shape)}"
        )
    chunks = triton.cdiv(kv_cache[0].numel(), _CHUNK)
    if chunks > _MAX_GRID_Y:
        raise ValueError(f"a block of {kv_cache[0].numel()} elements is too large")
    check_launchable(kv_cache, block_ids, staging)


def _copy_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, pack: bool
) -> None:
    n = block_ids.shape[0]
    if n == 0:
        return
    block_numel = kv_cache[0].numel()
    grid = (n, triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](
        kv_cache, staging, block_ids, block_numel, PACK=pack, CHUNK=_CHUNK, num_warps=4
    )


def pack_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather whole blocks into a contiguous staging buffer (see the reference).

    block_ids: [n] int32/int64, each in [0, num_blocks). Returns [n, *block].
    """
    if out is None:
        shape = (block_ids.shape[0], *kv_cache.shape[1:]) if block_ids.dim() == 1 else (0,)
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    _check_blocks(kv_cache, block_ids, out)
    _copy_blocks(kv_cache, block_ids, out, pack=True)
    return out[: block_ids.shape[0]]


def unpack_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter a staging buffer back: kv_cache[block_ids[i]] = staging[i].

    block_ids: [n] int32/int64, distinct, each in [0, num_blocks).
    """
    _check_blocks(kv_cache, block_ids, staging)
    _copy_blocks(kv_cache, block_ids, staging, pack=False)
