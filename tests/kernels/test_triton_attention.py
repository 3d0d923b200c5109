"""Triton paged attention (decode and prefill) against the torch reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import reference
from tests.kernels.kv_cases import NUM_KV_HEADS, TOL, block_tables, make_cache, randn

BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 128)
GROUPS = (1, 4)  # query heads per KV head
DTYPES = (torch.float32, torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[want.dtype])


def decode_lens(block_size: int) -> list[int]:
    """Very short and long contexts in one batch: 1 token, a partial first block,
    exactly one block, one past a block edge, and several blocks plus a partial one."""
    return [1, block_size - 3, block_size, block_size + 1, 1, 5 * block_size + 7]


GRID = pytest.mark.parametrize(
    "block_size,head_dim,group,dtype",
    [
        pytest.param(bs, hd, g, dt, id=f"bs{bs}-hd{hd}-gqa{g}-{str(dt)[6:]}")
        for bs in BLOCK_SIZES
        for hd in HEAD_DIMS
        for g in GROUPS
        for dt in DTYPES
    ],
)
# A few grid points for the costlier variations (the interpreter runs each program
# in Python, so the full grid gets one case and these get the rest).
CORNERS = pytest.mark.parametrize(
    "block_size,head_dim,group,dtype",
    [
        pytest.param(8, 64, 1, torch.float32, id="bs8-hd64-gqa1-float32"),
        pytest.param(16, 128, 4, torch.bfloat16, id="bs16-hd128-gqa4-bfloat16"),
        pytest.param(32, 64, 4, torch.float32, id="bs32-hd64-gqa4-float32"),
    ],
)


def _decode_case(block_size, head_dim, group, dtype, device):
    lens = decode_lens(block_size)
    cache = make_cache(24, block_size, head_dim, dtype, device)
    tables = block_tables(lens, block_size, 24).to(device)
    context_lens = torch.tensor(lens, device=device)
    q = randn(len(lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, device=device, seed=1)
    return q, cache, tables, context_lens, head_dim**-0.5


@GRID
def test_decode_matches_reference(triton_ops, device, block_size, head_dim, group, dtype):
    q, cache, tables, lens, scale = _decode_case(block_size, head_dim, group, dtype, device)
    want = reference.paged_decode_attention(q, cache, 1, tables, lens, scale)
    _close(triton_ops.paged_decode_attention(q, cache, 1, tables, lens, scale), want)


@CORNERS
def test_decode_split_context_matches_reference(
    triton_ops, device, block_size, head_dim, group, dtype
):
    """Flash-decoding: each context in 3 splits, some of them empty for the short
    contexts, merged by log-sum-exp."""
    q, cache, tables, lens, scale = _decode_case(block_size, head_dim, group, dtype, device)
    want = reference.paged_decode_attention(q, cache, 1, tables, lens, scale)
    got = triton_ops.paged_decode_attention(q, cache, 1, tables, lens, scale, num_splits=3)
    _close(got, want)


def test_decode_int32_indices_and_strided_query(triton_ops, device):
    """int32 tables/lengths, and q a strided view (as a slice of a fused projection)."""
    lens = [3, 40, 17]
    cache = make_cache(16, 16, 64, torch.float32, device)
    tables = block_tables(lens, 16, 16).to(device)
    fused = randn(3, 8 * 64 + 100, dtype=torch.float32, device=device, seed=2)
    q = fused[:, 100:].view(3, 8, 64)  # row stride 612
    lens_t = torch.tensor(lens, device=device)
    want = reference.paged_decode_attention(q, cache, 0, tables, lens_t, 0.125)
    got = triton_ops.paged_decode_attention(
        q, cache, 0, tables.int(), lens_t.int(), 0.125, num_splits=2
    )
    _close(got, want)


def test_decode_empty_batch(triton_ops, device):
    cache = make_cache(4, 16, 64, torch.float32, device)
    q = torch.empty(0, 2, 64, device=device)
    tables = torch.empty(0, 0, dtype=torch.int64, device=device)
    lens = torch.empty(0, dtype=torch.int64, device=device)
    out = triton_ops.paged_decode_attention(q, cache, 0, tables, lens, 0.1)
    assert out.shape == (0, 2, 64)


def _prefill(triton_ops, device, block_size, head_dim, group, dtype, start, n, seed=0):
    num_blocks = 24
    cache = make_cache(num_blocks, block_size, head_dim, dtype, device)
    table = block_tables([start + n], block_size, num_blocks, seed=seed)[0].to(device)
    q = randn(n, NUM_KV_HEADS * group, head_dim, dtype=dtype, device=device, seed=seed)
    scale = head_dim**-0.5
    want = reference.paged_prefill_attention(q, cache, 1, table, start, scale)
    _close(triton_ops.paged_prefill_attention(q, cache, 1, table, start, scale), want)


@GRID
def test_prefill_matches_reference(triton_ops, device, block_size, head_dim, group, dtype):
    """A chunk after a cached prefix, both ending mid-block."""
    start, n = block_size + 5, block_size + 2
    _prefill(triton_ops, device, block_size, head_dim, group, dtype, start, n)


@CORNERS
@pytest.mark.parametrize(
    "start,n",
    [(0, 1), (0, 19), (3, 70)],
    ids=["one-token-prompt", "first-chunk", "two-query-tiles"],
)
def test_prefill_edge_cases_match_reference(
    triton_ops, device, block_size, head_dim, group, dtype, start, n
):
    _prefill(triton_ops, device, block_size, head_dim, group, dtype, start, n, seed=n)


def test_prefill_table_longer_than_needed(triton_ops, device):
    """Blocks past the chunk's end (reserved for later tokens) are never read."""
    cache = make_cache(12, 8, 64, torch.float32, device)
    table = block_tables([12 * 8], 8, 12)[0].to(device)
    q = randn(5, 4, 64, dtype=torch.float32, device=device, seed=3)
    want = reference.paged_prefill_attention(q, cache, 0, table[:2], 9, 0.125)
    _close(triton_ops.paged_prefill_attention(q, cache, 0, table, 9, 0.125), want)


@CORNERS
def test_varlen_prefill_matches_each_chunk_alone(
    triton_ops, device, block_size, head_dim, group, dtype
):
    """One launch for a step's chunks: a one-token chunk, a first chunk, one after a cached
    prefix ending mid-block, and one spanning two query tiles; each equals the reference
    run on that chunk alone (a shorter chunk's programs past its end do nothing)."""
    chunks = [(0, 1), (0, 19), (block_size + 5, block_size + 2), (3, 70)]  # (start, n)
    num_blocks = 48
    cache = make_cache(num_blocks, block_size, head_dim, dtype, device)
    tables = block_tables([s + n for s, n in chunks], block_size, num_blocks, seed=5).to(device)
    total = sum(n for _, n in chunks)
    q = randn(total, NUM_KV_HEADS * group, head_dim, dtype=dtype, device=device, seed=6)
    cu = torch.tensor([0, *itertools.accumulate(n for _, n in chunks)], dtype=torch.int32)
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32)
    scale = head_dim**-0.5
    args = (q, cache, 1, tables, cu.to(device), starts.to(device), max(n for _, n in chunks))
    got = triton_ops.paged_prefill_attention_varlen(*args, scale)
    want = reference.paged_prefill_attention_varlen(*args, scale)
    _close(got, want)
    for i, (start, n) in enumerate(chunks):  # the reference's loop, spelled out
        lo = int(cu[i])
        alone = reference.paged_prefill_attention(q[lo : lo + n], cache, 1, tables[i], start, scale)
        _close(got[lo : lo + n], alone)


def test_varlen_prefill_rejects_mismatched_rows(triton_ops, device):
    cache = make_cache(4, 16, 64, torch.float32, device)
    q = torch.zeros(10, 4, 64, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int64, device=device)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=device)
    starts = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="2 block table rows"):
        triton_ops.paged_prefill_attention_varlen(q, cache, 0, tables, cu, starts, 10, 0.1)


# -- argument checks ---------------------------------------------------------------


def test_decode_rejects_bad_arguments(triton_ops, device):
    cache = make_cache(4, 16, 64, torch.float32, device)
    q = torch.zeros(2, 4, 64, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int64, device=device)
    lens = torch.ones(2, dtype=torch.int64, device=device)
    decode = triton_ops.paged_decode_attention
    with pytest.raises(ValueError, match="bfloat16"):
        decode(q.bfloat16(), cache, 0, tables, lens, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode(torch.zeros(2, 3, 64, device=device), cache, 0, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        decode(torch.zeros(2, 4, 32, device=device), cache, 0, tables, lens, 0.1)
    with pytest.raises(ValueError, match="3 queries"):
        decode(torch.zeros(3, 4, 64, device=device), cache, 0, tables, lens, 0.1)
    with pytest.raises(ValueError, match="stride 1"):
        decode(torch.zeros(2, 4, 128, device=device)[..., ::2], cache, 0, tables, lens, 0.1)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        decode(q, cache, 2, tables, lens, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        decode(q, cache, 0, tables.float(), lens, 0.1)
    with pytest.raises(ValueError, match="kv_cache"):
        decode(q, cache[:, 0], 0, tables, lens, 0.1)


def test_prefill_rejects_short_block_table(triton_ops, device):
    cache = make_cache(4, 16, 64, torch.float32, device)
    q = torch.zeros(10, 4, 64, device=device)
    table = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="need 2"):
        triton_ops.paged_prefill_attention(q, cache, 0, table, 10, 0.1)


def test_compiled_triton_rejects_cpu_tensors(triton_ops, monkeypatch):
    """Outside the interpreter, CPU tensors are a clear error, not a crash."""
    from kernels import triton_utils

    monkeypatch.setattr(triton_utils, "INTERPRETED", False)
    cache = make_cache(4, 16, 64, torch.float32, torch.device("cpu"))
    q = torch.zeros(1, 2, 64)
    one = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        triton_ops.paged_decode_attention(q, cache, 0, one, one[0] + 1, 0.1)
