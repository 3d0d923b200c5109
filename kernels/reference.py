"""Torch reference kernels over the block-major paged KV cache (see kernels/__init__)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V into their slots; negative slots are skipped.

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64.
    """
    block_size = kv_cache.shape[3]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_cache[blocks, layer, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, layer, 1, offsets] = v.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the blocks in `block_table` ([..., max_blocks]) as [..., max_blocks*bs, kvh, hd]."""
    # index_select of whole blocks (contiguous bs*kvh*hd runs) is several times faster
    # on CPU than advanced indexing (`kv_cache[block_table, layer, 0]`).
    lead = block_table.shape[:-1]
    flat = block_table.reshape(-1)
    k = kv_cache[:, layer, 0].index_select(0, flat)  # [n, bs, kvh, hd], contiguous
    v = kv_cache[:, layer, 1].index_select(0, flat)
    kvh, hd = k.shape[-2:]
    return k.view(*lead, -1, kvh, hd), v.view(*lead, -1, kvh, hd)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its cached context.

    q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] (padding
    entries may hold any valid block id); context_lens: [num_seqs] (the query's own
    token included, already stored). Returns [num_seqs, num_heads, head_dim].

    On CPU the batch is split into groups of similar context length (length_groups), so
    that one long context does not make every short one gather and attend over its
    length.
    """
    if q.device.type != "cpu":
        return _decode_attention(q, kv_cache, layer, block_tables, context_lens, scale)
    groups = length_groups(context_lens.tolist(), kv_cache.shape[3])
    if len(groups) == 1:
        width = groups[0][1]
        return _decode_attention(q, kv_cache, layer, block_tables[:, :width], context_lens, scale)
    out = torch.empty_like(q)
    for rows, width in groups:
        idx = torch.tensor(rows, device=q.device)
        out[idx] = _decode_attention(
            q[idx], kv_cache, layer, block_tables[idx, :width], context_lens[idx], scale
        )
    return out


def length_groups(context_lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Rows of a decode batch grouped by context length, longest first, as (rows, blocks
    each row of the group needs at most). A group ends where a row needs at most half its
    longest row's blocks: a row then pays at most twice its own gather and attention,
    and a batch forms at most log2(longest / shortest) + 1 groups."""
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    groups: list[tuple[list[int], int]] = []
    for i in order:
        blocks = -(-context_lens[i] // block_size)
        if groups and 2 * blocks > groups[-1][1]:
            groups[-1][0].append(i)
        else:
            groups.append(([i], blocks))
    return groups


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    k, v = gather_kv(kv_cache, layer, block_tables)  # [B, T, kvh, hd]
    num_kv_heads = k.shape[2]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    # The query heads that share a KV head go in as that head's query rows ([B, kvh,
    # heads/kvh, hd] against [B, kvh, T, hd]): one token attends its whole context, so
    # the rows need no causal mask, and SDPA runs a real q-tile instead of q length 1
    # with K/V repeated per head. On CPU that is about 2x faster in bfloat16 than
    # upcasting to float32 with enable_gqa (measured on one core: 8 sequences x 800
    # tokens, 1.4 ms a layer against 2.8 ms), and no slower in float32.
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk over its cached prefix plus itself.

    q: [n, num_heads, head_dim] for positions [start_pos, start_pos + n), whose K/V are
    already stored; block_table: [num_blocks_used]. Returns [n, num_heads, head_dim].
    """
    n, num_heads, head_dim = q.shape
    ctx = start_pos + n
    k, v = gather_kv(kv_cache, layer, block_table)
    k, v = k[:ctx], v[:ctx]
    gqa = k.shape[1] != num_heads
    # SDPA wants [1, heads, seq, dim]; transposed views, no copies. The batch dimension
    # matters: on CPU, 3-D inputs fall back to the unfused math kernel (about 5x slower).
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1).to(q.dtype)[None]
    vh = v.transpose(0, 1).to(q.dtype)[None]
    if start_pos == 0:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        qpos = torch.arange(start_pos, ctx, device=q.device)
        kpos = torch.arange(ctx, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)


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
    """Several sequences' causal chunks at once: q [total_q, num_heads, head_dim] holds them
    one after another, sequence i's as rows [cu_q[i], cu_q[i + 1]) at positions from
    start_pos[i]; block_tables [num_seqs, width]. `max_q` (the longest chunk) sizes a
    kernel's grid; unused here. Returns [total_q, num_heads, head_dim]."""
    out = torch.empty_like(q)
    bounds, starts = cu_q.tolist(), start_pos.tolist()
    for i, start in enumerate(starts):
        lo, hi = bounds[i], bounds[i + 1]
        if hi > lo:
            out[lo:hi] = paged_prefill_attention(
                q[lo:hi], kv_cache, layer, block_tables[i], start, scale
            )
    return out


def pack_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gather whole blocks into a contiguous staging buffer.

    block_ids: [n] int. out (optional, e.g. a registered buffer reused across
    transfers): [>= n, *kv_cache.shape[1:]]. Returns the [n, ...] staging tensor
    (a prefix of `out` when given) whose row i is kv_cache[block_ids[i]].
    """
    if out is None:
        return kv_cache.index_select(0, block_ids)
    dst = out[: block_ids.shape[0]]
    torch.index_select(kv_cache, 0, block_ids, out=dst)
    return dst


def unpack_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter a staging buffer back: kv_cache[block_ids[i]] = staging[i].

    staging: [>= n, *kv_cache.shape[1:]]; block_ids: [n] int, distinct (a block
    written twice has no defined value).
    """
    kv_cache.index_copy_(0, block_ids, staging[: block_ids.shape[0]])
