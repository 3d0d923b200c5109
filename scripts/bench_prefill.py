#!/usr/bin/env python3
"""Paged prefill attention throughput: the Triton varlen kernel against torch SDPA on K/V
already contiguous (what a paged kernel competes with), in TFLOP/s of causal attention.

    python scripts/bench_prefill.py [--lens 1024,4096,16384] [--heads 32] [--kv-heads 8]
                                    [--head-dim 128] [--dtype bfloat16] [--iters 10]
    TRITON_INTERPRET=1 python scripts/bench_prefill.py --smoke   # the script, on a CPU

One row per prompt length: one sequence's whole prompt, computed as one chunk. FLOPs count
the causal half of QK^T and PV: 2 * 2 * heads * head_dim * n * (n + 1) / 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed(fn, iters: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of fn() over iters runs, after one warm-up (the compile)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (interpreter)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.lens, args.heads, args.kv_heads, args.head_dim, args.iters = "40", 4, 2, 64, 1
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench_prefill: no CUDA device (--smoke runs on the CPU)", file=sys.stderr)
        return 3
    from kernels.dispatch import triton_kernels

    ops = triton_kernels()
    dtype, bs = DTYPES[args.dtype], args.block_size
    rows = []
    for n in [int(x) for x in args.lens.split(",")]:
        blocks = -(-n // bs)
        cache = torch.randn((blocks, 1, 2, bs, args.kv_heads, args.head_dim), device=device).to(
            dtype
        )
        table = torch.randperm(blocks, device=device)[None, :]
        q = torch.randn((n, args.heads, args.head_dim), device=device).to(dtype)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        start = torch.zeros(1, dtype=torch.int32, device=device)
        scale = args.head_dim**-0.5

        triton_run = functools.partial(
            ops.paged_prefill_attention_varlen, q, cache, 0, table, cu, start, n, scale
        )

        # SDPA on K/V gathered once, outside the timing: contiguous [1, heads, n, dim]
        kv = cache[table[0]]  # [blocks, 1, 2, bs, kvh, hd]
        k = kv[:, 0, 0].reshape(-1, args.kv_heads, args.head_dim)[:n].transpose(0, 1)[None]
        v = kv[:, 0, 1].reshape(-1, args.kv_heads, args.head_dim)[:n].transpose(0, 1)[None]
        k, v, qh = k.contiguous(), v.contiguous(), q.transpose(0, 1)[None].contiguous()

        sdpa_run = functools.partial(
            F.scaled_dot_product_attention, qh, k, v, is_causal=True, scale=scale, enable_gqa=True
        )

        flops = 2 * 2 * args.heads * args.head_dim * n * (n + 1) / 2
        t_triton, t_sdpa = (
            timed(triton_run, args.iters, device),
            timed(sdpa_run, args.iters, device),
        )
        row = {
            "len": n,
            "triton_ms": t_triton * 1e3,
            "sdpa_ms": t_sdpa * 1e3,
            "triton_tflops": flops / t_triton / 1e12,
            "sdpa_tflops": flops / t_sdpa / 1e12,
        }
        rows.append(row)
        cells = [
            f"{m} {row[m + '_ms']:8.3f} ms {row[m + '_tflops']:7.2f} TFLOP/s"
            for m in ("triton", "sdpa")
        ]
        print(f"len {n:6}: " + ", ".join(cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
