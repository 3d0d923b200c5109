#!/usr/bin/env python3
"""Compile every Triton kernel variant for CUDA GPUs, on a machine without one.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, not that
they compile: tl.dot's minimum shapes, 16-bit operand paths the interpreter
never takes, type errors in loops. This runs the real wrappers (same argument
checks, same launch arguments) on CPU stand-in tensors under a compile-only
Triton driver: each launch becomes a compile to a cubin for the target (Triton's
bundled ptxas), nothing runs. A kernel that does not build for sm_80 / sm_90
fails here, before it reaches a GPU.

    python scripts/compile_kernels.py [--arch 80,90] [--quick]

Exit status: 0 all compiled, 1 a compile failed, 3 no CUDA backend in this triton.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, don't interpret (before triton loads)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CompileOnlyDriver:
    """Just enough of a Triton driver for JITFunction.run(warmup=True) to compile."""

    def __init__(self, target: object, device: int) -> None:
        self.target = target
        self.device = device  # one per target: the JIT caches binders per device

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> object:
        return self.target


@contextlib.contextmanager
def compile_only(arch: int, compiled: list[tuple[str, int]]) -> Iterator[None]:
    """Within: kernel[grid](...) compiles for sm_{arch} and records (name, smem bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from kernels import triton_attention, triton_cache, triton_prefill

    def getitem(self: JITFunction, grid: object) -> Callable[..., object]:
        def launch(*args: object, **kwargs: object) -> object:
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append((self.__name__, kernel.metadata.shared))
            return kernel

        return launch

    saved = JITFunction.__getitem__, triton_attention.check_launchable
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32), arch))
    JITFunction.__getitem__ = getitem  # type: ignore[method-assign]
    # CPU stand-ins are fine here: nothing is launched.
    triton_attention.check_launchable = triton_cache.check_launchable = lambda *t: None
    triton_prefill.check_launchable = triton_attention.check_launchable
    try:
        yield
    finally:
        # The compile-only driver stays active: this process never launches a kernel.
        JITFunction.__getitem__ = saved[0]  # type: ignore[method-assign]
        triton_attention.check_launchable = triton_cache.check_launchable = saved[1]
        triton_prefill.check_launchable = saved[1]


def variants(quick: bool) -> Iterator[tuple[str, int, int, int]]:
    """(dtype, block_size, head_dim, group) to compile."""
    if quick:
        yield from [("bfloat16", 16, 128, 4), ("float32", 8, 64, 1)]
        return
    yield from itertools.product(DTYPES, (8, 16, 32), (64, 128), (1, 4, 8))


def compile_variant(dtype_name: str, block_size: int, head_dim: int, group: int) -> None:
    """Launch every kernel as the engine would: store, decode (whole and split
    context), prefill, and pack/unpack."""
    from kernels import triton_attention, triton_cache, triton_prefill

    dtype, kv_heads = DTYPES[dtype_name], 2
    heads = kv_heads * group
    cache = torch.zeros(4, 2, 2, block_size, kv_heads, head_dim, dtype=dtype)
    q = torch.zeros(3, heads, head_dim, dtype=dtype)
    kv = torch.zeros(3, kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(3, 256 // block_size, dtype=torch.int64)  # 256 tokens: splittable
    lens = torch.ones(3, dtype=torch.int64)
    triton_cache.store_kv(cache, 1, kv, kv, lens)
    for splits in (1, 2):
        triton_attention.paged_decode_attention(q, cache, 1, tables, lens, 0.1, splits)
    triton_prefill.paged_prefill_attention(q, cache, 1, tables[0], 2, 0.1)
    staging = triton_cache.pack_blocks(cache, lens[:2])
    triton_cache.unpack_blocks(staging, cache, lens[:2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    p.add_argument("--quick", action="store_true", help="a few variants instead of the grid")
    args = p.parse_args(argv)
    try:
        from triton.backends import backends

        if "nvidia" not in backends:
            raise ImportError(f"triton has no nvidia backend (has {sorted(backends)})")
    except ImportError as e:
        print(f"compile_kernels: cannot compile for CUDA: {e}", file=sys.stderr)
        return 3
    failures = 0
    for arch in (int(a) for a in args.arch.split(",")):
        for variant in variants(args.quick):
            compiled: list[tuple[str, int]] = []
            t0 = time.perf_counter()
            label = f"sm_{arch} {variant[0]} bs={variant[1]} hd={variant[2]} gqa={variant[3]}"
            try:
                with compile_only(arch, compiled):
                    compile_variant(*variant)
            except Exception:
                failures += 1
                print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
                continue
            smem = max(s for _, s in compiled)
            print(
                f"ok   {label}: {len(compiled)} kernels, max smem {smem} B, "
                f"{time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
