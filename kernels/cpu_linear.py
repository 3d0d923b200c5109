"""Linear layers on CPU through oneDNN with the weight prepacked once, at load.

`torch.nn.functional.linear` on CPU hands MKL a plain row-major weight on every
call; oneDNN's inner-product with a weight reordered once into its blocked
layout is 1.5-3x faster at the small row counts decoding runs (1-64 rows), and
the gain is largest on the 49k-row vocabulary projection. Measured on this
repository's default model by `scripts/bench_engine.py`.

Where the running torch or CPU cannot (no oneDNN, or a dtype the CPU lacks
instructions for, such as bfloat16 without AVX-512), `pack` returns None and the
caller keeps its plain weight.
"""

from __future__ import annotations

import torch


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-layout copy of `weight` ([out, in], CPU), or None if unavailable here."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if op is None:
        return None
    try:
        packed = op(weight.detach().contiguous())
        # One trial call: some dtypes pack but cannot run on this CPU.
        linear(
            torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device), packed, None
        )
    except RuntimeError:
        return None
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias with W prepacked by `pack`; x: [..., in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
