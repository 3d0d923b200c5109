"""Triton paged decode attention over the block-major KV cache (layout: kernels/__init__).

Both kernels gather K/V tiles token by token through the block table: token n
of a sequence lives in block table[n // block_size] at offset n % block_size, so
a tile's width (BLOCK_N tokens) does not depend on the block size, and one
program's tile may span several blocks.

Decode: a program per (sequence, KV head, context split) takes the whole GQA
group of query heads sharing that KV head, so each K/V tile is read once per KV
head. Long contexts are split (flash-decoding) so that a small batch still fills
the GPU; `_merge_kernel` combines the splits by their log-sum-exp.

Prefill is in kernels/triton_prefill.py; the tile helpers both use are in
kernels/triton_tiles.py.

Softmax runs in float32 in the log2 domain (exp2 with the scale folded in).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache,
    check_heads,
    check_tensor,
)
from kernels.triton_tiles import LOG2E, load_kv_tile, softmax_update
from kernels.triton_utils import check_launchable, dot_options

_MIN_SPLIT_TILES = 4  # don't split a context into pieces shorter than this many tiles
_MAX_SPLITS = 32


# Per-call scalars are not specialized on (== 1, divisible by 16): one compile each.
@triton.jit(do_not_specialize=["layer", "split_len"])
def _decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    tables_ptr,  # [num_seqs, max_blocks]
    lens_ptr,  # [num_seqs]
    out_ptr,  # SPLIT: float32 [num_seqs, num_heads, splits, head_dim]; else like q
    lse_ptr,  # SPLIT: float32 [num_seqs, num_heads, splits] (log2 domain)
    layer,
    scale_log2,
    split_len,  # tokens per split, a multiple of BLOCK_N
    stride_qs,
    stride_qh,
    stride_cb,
    stride_cl,
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_ts,
    stride_os,
    stride_oh,
    stride_osp,
    stride_ls,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    WIDEN: tl.constexpr,  # see triton_utils.dot_options
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # the query heads of this KV head
    mask_gd = mask_g[:, None] & mask_d[None, :]
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_gd,
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if WIDEN:
        q = q.to(tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_ts
    cache = cache_ptr + layer * stride_cl + kv_head * stride_ch
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx)
    # A finite floor keeps exp2(m_i - m_new) well defined while a row has seen
    # only masked scores.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = load_kv_tile(
            cache,
            table,
            pos,
            valid,
            offs_d,
            mask_d,
            stride_cb,
            stride_ct,
            stride_ckv,
            BLOCK_SIZE,
            WIDEN,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        # s: [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, cache_ptr, DOT_PRECISION)
    if SPLIT:
        # An empty split (past the context) leaves l_i = 0: weight 0 in the merge.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        out = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osp
        tl.store(out + offs_d[None, :], acc / l_safe[:, None], mask=mask_gd)
        tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=mask_g)
    else:
        out = out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_gd)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_ptr,  # float32 [num_seqs, num_heads, splits, head_dim]
    lse_ptr,  # float32 [num_seqs, num_heads, splits]
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_splits,
    stride_ps,
    stride_ph,
    stride_psp,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    w = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]; split 0 is never empty
    part = tl.load(
        part_ptr
        + seq * stride_ps
        + head * stride_ph
        + offs_s[:, None] * stride_psp
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: no point splitting
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(device: torch.device, programs: int, tiles: int) -> int:
    """Enough programs for about two waves over the GPU's SMs, without splitting a
    context into pieces shorter than _MIN_SPLIT_TILES tiles."""
    want = -(-2 * _sm_count(device) // max(programs, 1))
    return max(1, min(want, tiles // _MIN_SPLIT_TILES, _MAX_SPLITS))


def _check_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    check_cache(kv_cache, layer)
    check_tensor("q", q, 3, FLOAT_DTYPES, kv_cache.device)
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    check_heads(q.shape[1], kv_cache.shape[4], q.shape[2], kv_cache.shape[5])
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, q.device, False)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, q.device, False)
    num_seqs = q.shape[0]
    if not (block_tables.shape[0] == num_seqs and context_lens.shape[0] == num_seqs):
        raise ValueError(
            f"{num_seqs} queries but block_tables {tuple(block_tables.shape)} and "
            f"context_lens {tuple(context_lens.shape)}"
        )
    if not (num_seqs == 0 or block_tables.shape[1] > 0):
        raise ValueError("block_tables has no columns")
    check_launchable(q, kv_cache, block_tables, context_lens)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of kernels.reference.paged_decode_attention (same contract).

    q: [num_seqs, num_heads, head_dim], same dtype as kv_cache; block_tables:
    [num_seqs, max_blocks] int32/int64 (entries past a context are never read);
    context_lens: [num_seqs], each in [1, max_blocks * block_size]. num_splits:
    context splits per sequence (None: enough to fill the GPU). Returns
    [num_seqs, num_heads, head_dim].
    """
    _check_decode(q, kv_cache, layer, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    # The dot's M dim (query heads of a group) is padded to 16, tl.dot's minimum.
    block_g = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    block_n = 64 if block_d <= 64 else 32
    tiles = -(-block_tables.shape[1] * block_size // block_n)  # bound: no .max() sync
    if num_splits is None:
        num_splits = _num_splits(q.device, num_seqs * num_kv_heads, tiles)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = min(num_splits, tiles)
    split_len = -(-tiles // num_splits) * block_n
    split = num_splits > 1
    if split:
        part = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part, lse = out, out  # lse is unused without SPLIT
    sc = kv_cache.stride()
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, context_lens, part, lse,
        layer, scale * LOG2E, split_len,
        q.stride(0), q.stride(1),
        sc[0], sc[1], sc[2], sc[3], sc[4],
        block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2) if split else 0,
        lse.stride(0) if split else 0, lse.stride(1) if split else 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        SPLIT=split, **dot_options(q.dtype),
        num_warps=4,
    )  # fmt: skip
    if split:
        _merge_kernel[(num_seqs, num_heads)](
            part, lse, out, num_splits,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out
