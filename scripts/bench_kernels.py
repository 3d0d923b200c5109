#!/usr/bin/env python3
"""Paged decode attention: Triton kernel vs torch baselines (a benchmark, not a test).

For each batch size B and context length C: B sequences of C tokens each, their
blocks scattered over a one-layer paged cache. Columns (median time per call):

    triton     the Triton paged kernel (kernels/triton_attention.py)
    torch_ref  the torch reference: gather the blocks, then masked SDPA
    sdpa       SDPA alone on K/V already gathered into dense tensors: a dense
               kernel's time with the gather for free (a lower bound to beat)

plus the Triton kernel's KV read bandwidth and its max difference from torch_ref.
On a GPU it uses CUDA events; on CPU (a smoke test of this script) it runs a tiny
grid, and Triton only under TRITON_INTERPRET=1 (slow: it measures nothing).

    python scripts/bench_kernels.py                       # GPU defaults, or CPU tiny grid
    python scripts/bench_kernels.py --batches 1,64 --contexts 1024,4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.dispatch import KernelBackendError, triton_kernels  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--batches", default="1,8,32,128" if cuda else "1,4")
    p.add_argument("--contexts", default="512,2048,8192" if cuda else "64,256")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=32 if cuda else 4)
    p.add_argument("--kv-heads", type=int, default=8 if cuda else 2)
    p.add_argument("--head-dim", type=int, default=128 if cuda else 64)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16" if cuda else "float32")
    p.add_argument("--iters", type=int, default=50 if cuda else 3)
    p.add_argument(
        "--triton",
        choices=["auto", "on", "off"],
        default="auto",
        help="auto: on CUDA, or on CPU under TRITON_INTERPRET=1",
    )
    return p.parse_args(argv)


def timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    """Median microseconds per call of fn, after warm-up."""

    def run(fn: Callable[[], object]) -> float:
        for _ in range(min(3, iters)):
            fn()
        times: list[float] = []
        for _ in range(iters):
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    return run


def bench_one(
    args: argparse.Namespace, device: torch.device, batch: int, ctx: int, use_triton: bool
) -> dict[str, float]:
    dtype, bs = DTYPES[args.dtype], args.block_size
    per_seq = -(-ctx // bs)
    g = torch.Generator().manual_seed(batch * 100_003 + ctx)
    cache_shape = (batch * per_seq, 1, 2, bs, args.kv_heads, args.head_dim)
    cache = torch.randn(cache_shape, generator=g).to(device=device, dtype=dtype)
    tables = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).to(device)
    lens = torch.full((batch,), ctx, dtype=torch.int64, device=device)
    q = torch.randn(batch, args.heads, args.head_dim, generator=g).to(device=device, dtype=dtype)
    scale = args.head_dim**-0.5
    k, v = reference.gather_kv(cache, 0, tables)  # [B, per_seq*bs, kvh, hd]
    k = k[:, :ctx].transpose(1, 2).contiguous()  # [B, kvh, ctx, hd], dense
    v = v[:, :ctx].transpose(1, 2).contiguous()
    qd = q.view(batch, args.heads, 1, args.head_dim)
    gqa = args.heads != args.kv_heads
    time_it = timer(device, args.iters)
    row = {
        "torch_ref": time_it(
            lambda: reference.paged_decode_attention(q, cache, 0, tables, lens, scale)
        ),
        "sdpa": time_it(
            lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=gqa)
        ),
    }
    if use_triton:
        decode = triton_kernels().paged_decode_attention
        row["triton"] = time_it(lambda: decode(q, cache, 0, tables, lens, scale))
        want = reference.paged_decode_attention(q, cache, 0, tables, lens, scale)
        got = decode(q, cache, 0, tables, lens, scale)
        row["max_err"] = (got.float() - want.float()).abs().max().item()
        kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * cache.element_size()
        row["triton_gbs"] = kv_bytes / (row["triton"] * 1e-6) / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    use_triton = args.triton == "on" or (
        args.triton == "auto" and (device.type == "cuda" or interpreted)
    )
    if use_triton:
        try:
            triton_kernels()
        except KernelBackendError as e:
            print(f"bench_kernels: {e}; timing the torch baselines only", file=sys.stderr)
            use_triton = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"paged decode attention on {name}: {args.dtype}, heads {args.heads}/{args.kv_heads} "
        f"(q/kv), head_dim {args.head_dim}, block_size {args.block_size}, "
        f"median of {args.iters}; times in us"
    )
    cols = ["batch", "context", "triton", "torch_ref", "sdpa", "ref/triton", "sdpa/triton"]
    cols += ["triton_GB/s", "max_err"]
    print("".join(f"{c:>12}" for c in cols))
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            r = bench_one(args, device, batch, ctx, use_triton)
            t = r.get("triton")
            cells = [
                str(batch),
                str(ctx),
                f"{t:.1f}" if t else "-",
                f"{r['torch_ref']:.1f}",
                f"{r['sdpa']:.1f}",
                f"{r['torch_ref'] / t:.2f}x" if t else "-",
                f"{r['sdpa'] / t:.2f}x" if t else "-",
                f"{r['triton_gbs']:.0f}" if t else "-",
                f"{r['max_err']:.1e}" if t else "-",
            ]
            print("".join(f"{c:>12}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
