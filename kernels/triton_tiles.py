"""Triton building blocks both paged-attention kernels share: a K/V tile gathered through the
block table, and one step of the online softmax (float32, log2 domain).

Token n of a sequence lives in block table[n // block_size] at offset n % block_size, so a
tile's width (BLOCK_N tokens) does not depend on the block size.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(
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
def softmax_update(s, v, m_i, l_i, acc, cache_ptr, DOT_PRECISION: tl.constexpr):
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
