"""Attention and KV-cache kernels: torch references (CPU) and, later, Triton (CUDA).

KV cache layout (block-major, one tensor per node):
    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
One block is one contiguous region holding every layer's K and V for
`block_size` tokens, so a transfer needs one descriptor per block.
A slot is `block_id * block_size + offset`; a negative slot is padding.
"""

from kernels.reference import (
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
