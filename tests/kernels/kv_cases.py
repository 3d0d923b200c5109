"""Random paged-KV test cases: caches full of noise, shuffled block tables.

Every cache slot holds random values, padding entries of block tables point at
real blocks, and sequences' blocks are scattered: a kernel that reads past a
context, or through the wrong table entry, gets a wrong answer, not a lucky one.
"""

from __future__ import annotations

import torch

NUM_KV_HEADS = 2
NUM_LAYERS = 2
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def make_cache(
    num_blocks: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, NUM_LAYERS, 2, block_size, NUM_KV_HEADS, head_dim)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def block_tables(
    context_lens: list[int], block_size: int, num_blocks: int, seed: int = 0
) -> torch.Tensor:
    """[num_seqs, max_blocks] int64: each row a random draw of distinct blocks,
    padding included (rows may share blocks, as with a shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in context_lens)
    assert width <= num_blocks
    rows = [torch.randperm(num_blocks, generator=g)[:width] for _ in context_lens]
    return torch.stack(rows)


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)
