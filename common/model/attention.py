"""Paged attention for one forward step over a flat batch of tokens.

A step's tokens are laid out decode-first:
    [ d_0 d_1 ... d_{D-1} | p_0 chunk ... | p_1 chunk ... ]
Decode sequences contribute one token each; prefill sequences contribute a chunk
starting at their number of already-computed tokens (chunked prefill, or recompute
after preemption).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.dispatch import Kernels


@dataclass
class PrefillSlice:
    query_start: int  # offset of the chunk in the flat token batch
    query_len: int
    start_pos: int  # tokens of this sequence already in the cache
    block_table: torch.Tensor  # [num_blocks_used] int64


@dataclass
class PrefillBatch:
    """Every prefill chunk of the step, for a one-launch (varlen) prefill kernel: chunk i is
    rows [cu_q[i], cu_q[i + 1]) of the step's prefill tokens (those after the decodes)."""

    block_tables: torch.Tensor  # [num_prefills, width] int64, zero-padded
    cu_q: torch.Tensor  # [num_prefills + 1] int32
    start_pos: torch.Tensor  # [num_prefills] int32
    max_q: int  # the longest chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decode] int64
    prefills: list[PrefillSlice]
    kernels: Kernels  # the engine's kernel backend, resolved once (kernels/dispatch.py)
    # Set when the kernels have a varlen prefill: then one launch covers every chunk.
    prefill_batch: PrefillBatch | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] for the step's tokens. Returns [T, H, D]."""
    kern = meta.kernels
    kern.store_kv(kv_cache, layer, k, v, meta.slot_mapping)
    if not meta.prefills:
        return kern.paged_decode_attention(
            q, kv_cache, layer, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    out = torch.empty_like(q)
    nd = meta.num_decode
    if nd:
        out[:nd] = kern.paged_decode_attention(
            q[:nd], kv_cache, layer, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    batch = meta.prefill_batch
    if batch is not None and kern.paged_prefill_attention_varlen is not None:
        out[nd:] = kern.paged_prefill_attention_varlen(
            q[nd:], kv_cache, layer, batch.block_tables, batch.cu_q, batch.start_pos,
            batch.max_q, scale,
        )  # fmt: skip
        return out
    for p in meta.prefills:
        end = p.query_start + p.query_len
        out[p.query_start : end] = kern.paged_prefill_attention(
            q[p.query_start : end], kv_cache, layer, p.block_table, p.start_pos, scale
        )
    return out
