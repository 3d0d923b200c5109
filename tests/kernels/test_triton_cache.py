"""Triton KV store and block pack/unpack against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.kv_cases import NUM_KV_HEADS, make_cache, randn


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("block_size", (8, 16, 32))
def test_store_kv_matches_reference(triton_ops, device, block_size, head_dim, dtype):
    """Negative (padding) slots are skipped; k/v are strided views of a fused
    projection, as the model hands them over; slots land across blocks."""
    num_blocks = 6
    cache = make_cache(num_blocks, block_size, head_dim, dtype, device)
    last = num_blocks * block_size - 1
    slots = [0, -1, block_size - 1, block_size, 3 * block_size + 2, -7, last, 2 * block_size]
    slot_mapping = torch.tensor(slots, device=device)
    kv = NUM_KV_HEADS * head_dim
    fused = randn(len(slots), 64 + 2 * kv, dtype=dtype, device=device, seed=4)
    k = fused[:, 64 : 64 + kv].view(-1, NUM_KV_HEADS, head_dim)
    v = fused[:, 64 + kv :].view(-1, NUM_KV_HEADS, head_dim)
    want, got = cache.clone(), cache.clone()
    reference.store_kv(want, 1, k, v, slot_mapping)
    triton_ops.store_kv(got, 1, k, v, slot_mapping)
    assert torch.equal(got, want)
    assert not torch.equal(got, cache)  # it stored something


def test_store_kv_casts_and_takes_int32_slots(triton_ops, device):
    cache = make_cache(4, 16, 64, torch.bfloat16, device)
    k = randn(3, NUM_KV_HEADS, 64, dtype=torch.float32, device=device, seed=5)
    v = randn(3, NUM_KV_HEADS, 64, dtype=torch.float32, device=device, seed=6)
    slots = torch.tensor([5, -1, 63], device=device)
    want, got = cache.clone(), cache.clone()
    reference.store_kv(want, 0, k, v, slots)
    triton_ops.store_kv(got, 0, k, v, slots.int())
    assert torch.equal(got, want)


def test_store_kv_all_padding_and_empty(triton_ops, device):
    cache = make_cache(2, 8, 64, torch.float32, device)
    before = cache.clone()
    k = torch.ones(2, NUM_KV_HEADS, 64, device=device)
    triton_ops.store_kv(cache, 0, k, k, torch.tensor([-1, -2], device=device))
    triton_ops.store_kv(cache, 0, k[:0], k[:0], torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def test_store_kv_rejects_bad_arguments(triton_ops, device):
    cache = make_cache(2, 8, 64, torch.float32, device)
    k = torch.zeros(3, NUM_KV_HEADS, 64, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"\[num_tokens, 2, 64\]"):
        triton_ops.store_kv(cache, 0, k[:, :1], k[:, :1], slots)
    with pytest.raises(ValueError, match="3 slots"):
        triton_ops.store_kv(cache, 0, k[:2], k[:2], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_ops.store_kv(cache, 0, k, k, slots.float())


def _ids(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, device=device)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("block_size", (8, 32))
def test_pack_matches_reference(triton_ops, device, block_size, dtype):
    cache = make_cache(10, block_size, 64, dtype, device)
    ids = _ids([7, 0, 9, 3], device)
    want = reference.pack_blocks(cache, ids)
    got = triton_ops.pack_blocks(cache, ids)
    assert got.shape == (4, *cache.shape[1:]) and got.is_contiguous()
    assert torch.equal(got, want)
    # Into a caller's (larger, reused) staging buffer: a prefix of it is filled.
    buf = torch.zeros(6, *cache.shape[1:], dtype=dtype, device=device)
    got = triton_ops.pack_blocks(cache, ids.int(), buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
    assert not buf[4:].any()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_unpack_matches_reference(triton_ops, device, dtype):
    cache = make_cache(10, 16, 64, dtype, device)
    staging = randn(5, *cache.shape[1:], dtype=dtype, device=device, seed=7)
    ids = _ids([2, 8, 5], device)
    want, got = cache.clone(), cache.clone()
    reference.unpack_blocks(staging, want, ids)
    triton_ops.unpack_blocks(staging, got, ids)
    assert torch.equal(got, want)
    assert torch.equal(got[8], staging[1]) and torch.equal(got[0], cache[0])


def test_pack_unpack_round_trip(device):
    """The reference pair itself: pack a cache's blocks, unpack them elsewhere."""
    src = make_cache(6, 8, 64, torch.float32, device, seed=1)
    dst = torch.zeros_like(src)
    reference.unpack_blocks(
        reference.pack_blocks(src, _ids([4, 1], device)), dst, _ids([0, 5], device)
    )
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[5], src[1])
    assert not dst[1:5].any()


def test_pack_rejects_bad_arguments(triton_ops, device):
    cache = make_cache(4, 8, 64, torch.float32, device)
    ids = _ids([1, 2], device)
    with pytest.raises(ValueError, match="staging must be"):
        triton_ops.pack_blocks(cache, ids, torch.empty(1, *cache.shape[1:], device=device))
    with pytest.raises(ValueError, match="staging"):
        triton_ops.pack_blocks(cache, ids, torch.empty(2, *cache.shape[1:], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        triton_ops.pack_blocks(cache.transpose(3, 4), ids)
    with pytest.raises(ValueError, match="block_ids"):
        triton_ops.unpack_blocks(cache[:2], cache, ids.view(1, 2))
