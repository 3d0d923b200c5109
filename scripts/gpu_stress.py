#!/usr/bin/env python3
"""The Triton kernels on a CUDA GPU, compiled, against the float32 torch reference: a grid
of the shapes the interpreter never runs (native bf16/fp16, group size 8, head_dim 96, block
sizes 1 and 128, contexts to 32k, a forced single split, a prefill chunk at position 30k,
a cache of more than 2^31 elements). Unused cache slots hold NaN, so a kernel that reads a
slot it should not returns NaN and fails.

    python scripts/gpu_stress.py [--json OUT] [--quick]
    TRITON_INTERPRET=1 python scripts/gpu_stress.py --smoke   # the script itself, on a CPU

One line per case; the JSON has every case (shape, max abs error, tolerance, time). Exit
status 0 when every case passes, 1 otherwise, 3 without a CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels import reference  # noqa: E402

DEV = "cuda"  # --smoke: "cpu", the kernels under the Triton interpreter


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # max abs error against float32, O(1) outputs
HEADS = [(32, 8), (64, 8)]  # (query heads, KV heads)
HEAD_DIMS = [64, 96, 128]
BLOCK_SIZES = [1, 16, 128]
CONTEXTS = [1, 17, 1000, 8191, 32768]


def nan_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    shape = (num_blocks, 2, 2, block_size, kv_heads, head_dim)  # two layers: layer 1 is used
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def fill_used(cache: torch.Tensor, tables: list[list[int]], lens: list[int]) -> None:
    """Random values in exactly the slots the contexts use (layer 1, K and V)."""
    bs = cache.shape[3]
    blocks, offsets = [], []
    for table, n in zip(tables, lens, strict=True):
        pos = torch.arange(n)
        blocks.append(torch.tensor(table)[pos // bs])
        offsets.append(pos % bs)
    b = torch.cat(blocks).to(DEV)
    o = torch.cat(offsets).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    values = torch.randn((b.numel(), 2, *cache.shape[4:]), generator=g, device=DEV)
    cache[b, 1, :, o] = values.to(cache.dtype)


def tables_for(lens: list[int], block_size: int, num_blocks: int, top: bool) -> list[list[int]]:
    """Disjoint, shuffled block lists; `top`: taken from the highest block ids (far offsets)."""
    need = [-(-n // block_size) for n in lens]
    ids = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1))
    if top:
        ids = ids + (num_blocks - sum(need))
    out, at = [], 0
    for k in need:
        out.append(ids[at : at + k].tolist())
        at += k
    return out


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEV)


def decode_case(triton_ops, dtype, heads, head_dim, block_size, ctx, splits) -> dict:
    qh, kvh = heads
    lens = [ctx, max(1, ctx // 3), 1]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = nan_cache(num_blocks, block_size, kvh, head_dim, dtype)
    tables = tables_for(lens, block_size, num_blocks, top=False)
    fill_used(cache, tables, lens)
    q = torch.randn(len(lens), qh, head_dim, device=DEV).to(dtype)
    bt, cl = padded(tables), torch.tensor(lens, device=DEV)
    scale = head_dim**-0.5
    sync()
    t0 = time.perf_counter()
    got = triton_ops.paged_decode_attention(q, cache, 1, bt, cl, scale, num_splits=splits)
    sync()
    seconds = time.perf_counter() - t0
    # The reference sees the NaNs as zeros (its masked SDPA would carry 0 * NaN); the
    # kernel sees them as they are, so a slot it should not read shows up in its output.
    want = reference.paged_decode_attention(q.float(), clean(cache), 1, bt, cl, scale)
    return _judge(got, want, dtype, seconds)


def prefill_case(triton_ops, dtype, heads, head_dim, block_size, start, n, big=False) -> dict:
    qh, kvh = heads
    lens = [start + n, 40]
    need = sum(-(-x // block_size) for x in lens)
    num_blocks = need + 3
    if big:  # more than 2^31 elements: offsets past int32
        per_block = 2 * 2 * block_size * kvh * head_dim
        num_blocks = max(num_blocks, (2**31) // per_block + need + 8)
    cache = nan_cache(num_blocks, block_size, kvh, head_dim, dtype)
    tables = tables_for(lens, block_size, num_blocks, top=big)
    fill_used(cache, tables, lens)
    chunks = [(start, n), (0, 40)]
    total = sum(c for _, c in chunks)
    q = torch.randn(total, qh, head_dim, device=DEV).to(dtype)
    cu = torch.tensor([0, n, total], dtype=torch.int32, device=DEV)
    sp = torch.tensor([start, 0], dtype=torch.int32, device=DEV)
    bt = padded(tables)
    scale = head_dim**-0.5
    sync()
    t0 = time.perf_counter()
    got = triton_ops.paged_prefill_attention_varlen(q, cache, 1, bt, cu, sp, max(n, 40), scale)
    sync()
    seconds = time.perf_counter() - t0
    if big:  # the reference gathers whole tables: give it a compact copy of the used blocks
        used = sorted({b for t in tables for b in t})
        remap = {b: i for i, b in enumerate(used)}
        small = clean(cache[used])
        bt = padded([[remap[b] for b in t] for t in tables])
        cache_ref = small
    else:
        cache_ref = clean(cache)
    want = reference.paged_prefill_attention_varlen(
        q.float(), cache_ref, 1, bt, cu, sp, max(n, 40), scale
    )
    return _judge(got, want, dtype, seconds)


def clean(cache: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(cache.float(), nan=0.0)


def _judge(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, seconds: float) -> dict:
    err = (got.float() - want).abs()
    nan = bool(torch.isnan(got).any())
    max_err = float("nan") if nan else float(err.max())
    return {
        "max_abs_err": max_err,
        "tol": TOL[dtype],
        "nan": nan,
        "ok": not nan and max_err <= TOL[dtype],
        "ms": round(seconds * 1e3, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="bf16 only, fewer contexts")
    ap.add_argument("--smoke", action="store_true", help="a few small cases on the CPU")
    args = ap.parse_args()
    global DEV, HEADS, HEAD_DIMS, BLOCK_SIZES
    if args.smoke:
        DEV, HEADS, HEAD_DIMS, BLOCK_SIZES = "cpu", [(8, 2)], [64], [16]
    elif not torch.cuda.is_available():
        print("gpu_stress: no CUDA device", file=sys.stderr)
        return 3
    from kernels.dispatch import triton_kernels

    ops = triton_kernels()
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    contexts = [1, 1000, 32768] if args.quick else CONTEXTS
    if args.smoke:
        dtypes, contexts = [torch.bfloat16], [1, 70]
    cases = []
    grid = itertools.product(dtypes, HEADS, HEAD_DIMS, BLOCK_SIZES, contexts, [None, 1])
    for dtype, heads, hd, bs, ctx, splits in grid:
        r = decode_case(ops, dtype, heads, hd, bs, ctx, splits)
        cases.append(
            {
                "kind": "decode",
                "dtype": str(dtype)[6:],
                "heads": heads,
                "head_dim": hd,
                "block_size": bs,
                "context": ctx,
                "splits": splits or "auto",
                **r,
            }
        )
    start, n = (100, 20) if args.smoke else (30000, 256)
    for dtype, heads, hd, bs in itertools.product(dtypes, HEADS, HEAD_DIMS, BLOCK_SIZES[-2:]):
        r = prefill_case(ops, dtype, heads, hd, bs, start, n)
        cases.append(
            {
                "kind": f"prefill@{start}",
                "dtype": str(dtype)[6:],
                "heads": heads,
                "head_dim": hd,
                "block_size": bs,
                "context": start + n,
                **r,
            }
        )
    if not args.smoke:  # a 4 GiB cache
        r = prefill_case(ops, torch.bfloat16, (32, 8), 128, 16, 100, 200, big=True)
        cases.append(
            {
                "kind": "prefill, cache > 2^31 elements",
                "dtype": "bfloat16",
                "heads": (32, 8),
                "head_dim": 128,
                "block_size": 16,
                "context": 300,
                **r,
            }
        )
    failed = [c for c in cases if not c["ok"]]
    for c in cases:
        mark = "ok  " if c["ok"] else "FAIL"
        print(
            f"{mark} {c['kind']:>12} {c['dtype']:8} heads {c['heads']} hd {c['head_dim']:3} "
            f"bs {c['block_size']:3} ctx {c['context']:5} splits {c.get('splits', '-')!s:4} "
            f"err {c['max_abs_err']:.2e} (tol {c['tol']:.0e}) {c['ms']:.2f} ms"
        )
    print(f"gpu_stress: {len(cases) - len(failed)}/{len(cases)} cases pass")
    if args.json:
        args.json.write_text(json.dumps({"cases": cases, "failed": len(failed)}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
