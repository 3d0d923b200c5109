"""Triton paged attention over the block-major KV cache (layout: kernels/__init__).

Both kernels gather K/V tiles token by token through the block table: token n
of a sequence lives in block table[n // block_size] at offset n % block_size, so
a tile's width (BLOCK_N tokens) does not depend on the block size, and one
program's tile may span several blocks.

Decode: a program per (sequence, KV head, context split) takes the whole GQA
group of query heads sharing that KV head, so each K/V tile is read once per KV
head. Long contexts are split (flash-decoding) so that a small batch still fills
the GPU; `_merge_kernel` combines the splits by their log-sum-exp.

Prefill: a program per (query tile, query head) runs causal flash attention of
one sequence's chunk over its cached prefix plus itself.

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
    require,
)
from kernels.triton_utils import check_launchable, dot_options

LOG2E = 1.4426950408889634
_MIN_SPLIT_TILES = 4  # don't split a context into pieces shorter than this many tiles
_MAX_SPLITS = 32


# Per-call scalars are not specialized on (== 1, divisible by 16): one compile each.
@triton.jit
def _load_kv_tile(
    cache,
    table,
    pos,
    valid,
    offs_d,
    mask_d,
    stride_cb,
    stride_ct,
    stride_ckv,
    BLOCK_SIZE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """K and V ([BLOCK_N, BLOCK_D]) of the tokens at `pos` of a sequence, through its block
    table (token by token, so the tile width does not depend on the block size)."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    token = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct  # [BLOCK_N]
    ptrs = cache + token[:, None] + offs_d[None, :]
    mask_nd = valid[:, None] & mask_d[None, :]
    k = tl.load(ptrs, mask=mask_nd, other=0.0)
    v = tl.load(ptrs + stride_ckv, mask=mask_nd, other=0.0)
    if WIDEN:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _softmax_update(s, v, m_i, l_i, acc, cache_ptr, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax: fold masked log2-scores `s` and values `v` into the
    running max `m_i`, normaliser `l_i` and output `acc`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # p is rounded to the cache dtype, as a 16-bit dot takes it, widened or not.
    pv = p.to(cache_ptr.dtype.element_ty).to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


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
        k, v = _load_kv_tile(
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
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, cache_ptr, DOT_PRECISION)
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
    require(q.dtype == kv_cache.dtype, f"q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    check_heads(q.shape[1], kv_cache.shape[4], q.shape[2], kv_cache.shape[5])
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, q.device, False)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, q.device, False)
    num_seqs = q.shape[0]
    require(
        block_tables.shape[0] == num_seqs and context_lens.shape[0] == num_seqs,
        f"{num_seqs} queries but block_tables {tuple(block_tables.shape)} and "
        f"context_lens {tuple(context_lens.shape)}",
    )
    require(num_seqs == 0 or block_tables.shape[1] > 0, "block_tables has no columns")
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
    require(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
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


@triton.jit(do_not_specialize=["layer", "start_pos", "num_q"])
def _prefill_kernel(
    q_ptr,  # [num_q, num_heads, head_dim]
    cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    table_ptr,  # [num_blocks_used]
    out_ptr,  # [num_q, num_heads, head_dim]
    layer,
    start_pos,
    num_q,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cl,
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDEN: tl.constexpr,  # see triton_utils.dot_options
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_md = (offs_m < num_q)[:, None] & mask_d[None, :]
    q = tl.load(
        q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_md,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if WIDEN:
        q = q.to(tl.float32)
    q_pos = start_pos + offs_m  # absolute positions of this tile's queries
    cache = cache_ptr + layer * stride_cl + kv_head * stride_ch
    # Causal: this tile sees keys [0, its last query's position].
    hi = tl.minimum(start_pos + (tile + 1) * BLOCK_M, start_pos + num_q)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = _load_kv_tile(
            cache,
            table_ptr,
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
        # s: [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, cache_ptr, DOT_PRECISION)
    out = out_ptr + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_md)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
) -> torch.Tensor:
    """Triton version of kernels.reference.paged_prefill_attention (same contract).

    q: [n, num_heads, head_dim] for positions [start_pos, start_pos + n), whose K/V
    are already stored; block_table: [>= ceil((start_pos + n) / block_size)] int.
    Returns [n, num_heads, head_dim].
    """
    check_cache(kv_cache, layer)
    check_tensor("q", q, 3, FLOAT_DTYPES, kv_cache.device)
    require(q.dtype == kv_cache.dtype, f"q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    check_heads(num_heads, num_kv_heads, head_dim, kv_cache.shape[5])
    check_tensor("block_table", block_table, 1, INDEX_DTYPES, q.device, False)
    require(start_pos >= 0, f"start_pos must be >= 0, got {start_pos}")
    need = -(-(start_pos + n) // block_size)
    require(
        block_table.shape[0] >= need,
        f"block_table has {block_table.shape[0]} blocks; positions up to "
        f"{start_pos + n} need {need}",
    )
    check_launchable(q, kv_cache, block_table)
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_m = 64
    block_n = 64 if block_d <= 64 else 32
    sc = kv_cache.stride()
    _prefill_kernel[(triton.cdiv(n, block_m), num_heads)](
        q, kv_cache, block_table, out,
        layer, start_pos, n, scale * LOG2E,
        q.stride(0), q.stride(1),
        sc[0], sc[1], sc[2], sc[3], sc[4],
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        **dot_options(q.dtype),
        num_warps=4,
    )  # fmt: skip
    return out
