"""Attention and KV-cache kernels: torch references (CPU) and Triton (CUDA).

KV cache layout (block-major, one tensor per node):
    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
One block is one contiguous region holding every layer's K and V for
`block_size` tokens, so a transfer needs one descriptor per block.
A slot is `block_id * block_size + offset`; a negative slot is padding.

Kernels, each in `reference.py` (torch) and in Triton beside it:
    store_kv                 new tokens' K/V into their slots (triton_cache.py)
    paged_decode_attention   one query per sequence, GQA, ragged contexts (triton_attention.py)
    paged_prefill_attention  a causal chunk over its cached prefix (triton_prefill.py)
    pack_blocks / unpack_blocks  blocks <-> a contiguous staging buffer (triton_cache.py)
Prefill is a Triton flash-attention kernel too, not torch SDPA: SDPA would need
the prefix gathered out of the paged cache into a contiguous copy first, which
is the traffic a paged kernel exists to avoid.

`dispatch.py` picks the implementation (PDSERVE_KERNELS=auto|triton|torch,
`set_backend`, or `EngineConfig.kernel_backend`); the functions exported here
dispatch per call. Triton is imported only when first needed.
"""

from kernels.dispatch import (
    BACKENDS,
    Kernels,
    get_backend,
    kernels_for,
    pack_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    set_backend,
    store_kv,
    unpack_blocks,
)

__all__ = [
    "BACKENDS",
    "Kernels",
    "get_backend",
    "kernels_for",
    "pack_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "set_backend",
    "store_kv",
    "unpack_blocks",
]
