"""Triton paged prefill attention over the block-major KV cache (layout: kernels/__init__).

A program per (query tile, query head, sequence) runs causal flash attention of one
sequence's chunk over its cached prefix plus itself, gathering K/V tiles through its row of
the block tables (kernels/triton_tiles.py): every prefill of a step is one launch per layer
(varlen, as vLLM's and SGLang's extend kernels). Softmax runs in float32 in the log2 domain.
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
@triton.jit(do_not_specialize=["layer"])
def _prefill_kernel(
    q_ptr,  # [total_q, num_heads, head_dim]: every sequence's chunk, one after another
    cache_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    table_ptr,  # [num_seqs, table_width]
    cu_q_ptr,  # [num_seqs + 1]: sequence i's queries are rows [cu_q[i], cu_q[i + 1])
    start_ptr,  # [num_seqs]: tokens of sequence i already cached before its chunk
    out_ptr,  # [total_q, num_heads, head_dim]
    layer,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_tab,
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
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    num_q = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= num_q:  # the grid covers the longest chunk; this one is shorter
        return
    start_pos = tl.load(start_ptr + seq)
    table = table_ptr + seq * stride_tab
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_md = (offs_m < num_q)[:, None] & mask_d[None, :]
    rows = q_start + offs_m
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
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
        # s: [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, cache_ptr, DOT_PRECISION)
    out = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_md)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
) -> torch.Tensor:
    """Triton version of kernels.reference.paged_prefill_attention (same contract): the
    varlen kernel with one sequence.

    q: [n, num_heads, head_dim] for positions [start_pos, start_pos + n), whose K/V
    are already stored; block_table: [>= ceil((start_pos + n) / block_size)] int.
    Returns [n, num_heads, head_dim].
    """
    check_tensor("q", q, 3, FLOAT_DTYPES, kv_cache.device)
    check_tensor("block_table", block_table, 1, INDEX_DTYPES, q.device, False)
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    n = q.shape[0]
    block_size = kv_cache.shape[3] if kv_cache.dim() == 6 else 1
    need = -(-(start_pos + n) // block_size)
    if block_table.shape[0] < need:
        raise ValueError(
            f"block_table has {block_table.shape[0]} blocks; positions up to "
            f"{start_pos + n} need {need}"
        )
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    starts = torch.tensor([start_pos], dtype=torch.int32, device=q.device)
    return paged_prefill_attention_varlen(
        q, kv_cache, layer, block_table[None, :], cu_q, starts, n, scale
    )


def paged_prefill_attention_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    start_pos: torch.Tensor,
    max_q: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of several sequences' chunks in one launch.

    q: [total_q, num_heads, head_dim], the chunks one after another: sequence i's queries
    are rows [cu_q[i], cu_q[i + 1]), at positions [start_pos[i], start_pos[i] + its length),
    their K/V already stored; block_tables: [num_seqs, width] int, row i covering sequence
    i's positions; cu_q: [num_seqs + 1] int, nondecreasing from 0 to total_q; start_pos:
    [num_seqs] int, >= 0; max_q: the longest chunk (a host int: it sizes the grid, so the
    caller that built cu_q passes it rather than have it read back from the device).
    Values are the caller's contract (not read here). Returns [total_q, num_heads, head_dim].
    """
    check_cache(kv_cache, layer)
    check_tensor("q", q, 3, FLOAT_DTYPES, kv_cache.device)
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    total, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    check_heads(num_heads, num_kv_heads, head_dim, kv_cache.shape[5])
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, q.device, False)
    check_tensor("cu_q", cu_q, 1, INDEX_DTYPES, q.device, False)
    check_tensor("start_pos", start_pos, 1, INDEX_DTYPES, q.device, False)
    num_seqs = block_tables.shape[0]
    if cu_q.shape[0] != num_seqs + 1 or start_pos.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} block table rows but cu_q {tuple(cu_q.shape)} and start_pos "
            f"{tuple(start_pos.shape)}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must have stride 1 in its last dim")
    if max_q < 0:
        raise ValueError(f"max_q must be >= 0, got {max_q}")
    check_launchable(q, kv_cache, block_tables, cu_q, start_pos)
    out = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total == 0 or num_seqs == 0 or max_q == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_m = 64
    block_n = 64 if block_d <= 64 else 32
    sc = kv_cache.stride()
    _prefill_kernel[(triton.cdiv(max_q, block_m), num_heads, num_seqs)](
        q, kv_cache, block_tables, cu_q, start_pos, out,
        layer, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0),
        sc[0], sc[1], sc[2], sc[3], sc[4],
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        **dot_options(q.dtype),
        num_warps=4,
    )  # fmt: skip
    return out
