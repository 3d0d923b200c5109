"""The torch reference decode attention against attention written out per sequence.

On CPU the reference splits a batch into groups of similar context length and attends low
precision in float32; both are optimisations that must not change an answer."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from tests.kernels.kv_cases import NUM_KV_HEADS, TOL, block_tables, make_cache, randn

CPU = torch.device("cpu")


def naive_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Softmax(q k^T) v for each sequence and head, in float64, slot by slot."""
    bs = cache.shape[3]
    group = q.shape[1] // NUM_KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens):
        slots = [(int(tables[i, p // bs]), p % bs) for p in range(n)]
        k = torch.stack([cache[b, layer, 0, o] for b, o in slots]).double()  # [n, kvh, hd]
        v = torch.stack([cache[b, layer, 1, o] for b, o in slots]).double()
        for h in range(q.shape[1]):
            kv_head = h // group
            w = torch.softmax(k[:, kv_head] @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ v[:, kv_head]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens",
    [[5], [33, 33, 31], [200, 17, 3, 64, 150, 1, 90], [1, 1, 2], [129, 16, 17, 15]],
    ids=["one", "alike", "mixed", "tiny", "edges"],
)
def test_decode_matches_attention_per_sequence(dtype: torch.dtype, lens: list[int]) -> None:
    bs, hd, heads = 16, 32, 2 * NUM_KV_HEADS
    num_blocks = 40
    cache = make_cache(num_blocks, bs, hd, dtype, CPU, seed=1)
    tables = block_tables(lens, bs, num_blocks, seed=2)
    q = randn(len(lens), heads, hd, dtype=dtype, device=CPU, seed=3)
    scale = 1 / math.sqrt(hd)
    got = reference.paged_decode_attention(q, cache, 1, tables, torch.tensor(lens), scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = naive_decode(q, cache, 1, tables, lens, scale)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


def test_decode_empty_batch() -> None:
    cache = make_cache(4, 16, 32, torch.float32, CPU)
    q = torch.empty(0, 4, 32)
    tables = torch.empty(0, 0, dtype=torch.int64)
    out = reference.paged_decode_attention(
        q, cache, 0, tables, torch.empty(0, dtype=torch.int64), 1.0
    )
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize(
    "lens",
    [[800] + [60] * 30, [1, 2, 4, 8, 16, 32, 64, 128, 256], [16] * 5, list(range(1, 300, 7))],
)
def test_length_groups_cover_each_row_once_within_twice_its_blocks(lens: list[int]) -> None:
    bs = 16
    groups = reference.length_groups(lens, bs)
    rows = sorted(r for members, _ in groups for r in members)
    assert rows == list(range(len(lens)))
    for members, width in groups:
        needed = [-(-lens[r] // bs) for r in members]
        assert max(needed) == width  # the table is cut to the group's longest row
        assert all(2 * n > width for n in needed)  # nobody pays over twice its blocks
    longest, shortest = max(lens), min(lens)
    bound = math.log2(-(-longest // bs) / -(-shortest // bs)) + 1
    assert len(groups) <= bound
