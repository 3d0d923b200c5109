"""Triton paged prefill attention over the block-major KV cache (layout: kernels/__init__).

A program per (query tile, query head) runs causal flash attention of one sequence's chunk
over its cached prefix plus itself, gathering K/V tiles through the block table
(kernels/triton_tiles.py). Softmax runs in float32 in the log2 domain.
"""

from __future__ import annotations

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


# Per-call scalars are not specialized on (== 1, divisible by 16): one compile each.
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
        k, v = load_kv_tile(
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
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, cache_ptr, DOT_PRECISION)
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
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    check_heads(num_heads, num_kv_heads, head_dim, kv_cache.shape[5])
    check_tensor("block_table", block_table, 1, INDEX_DTYPES, q.device, False)
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    need = -(-(start_pos + n) // block_size)
    if block_table.shape[0] < need:
        raise ValueError(
            f"block_table has {block_table.shape[0]} blocks; positions up to "
            f"{start_pos + n} need {need}"
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
