"""Linear layers on CPU through oneDNN with the weight prepacked once, at load.

`torch.nn.functional.linear` on CPU hands MKL a plain row-major weight on every
call; oneDNN's inner-product with a weight reordered once into its blocked
layout is 1.5-3x faster at the small row counts decoding runs (1-64 rows), and
the gain is largest on the 49k-row vocabulary projection. Measured on this
repository's default model by `scripts/bench_engine.py`.

Where the running torch or CPU cannot (no oneDNN, or a dtype the CPU lacks
instructions for, such as bfloat16 without AVX-512), `pack` returns None and the
caller keeps its plain weight.

A weight that is 4-bit already (a Q4_1 GGUF's, such as the built-in SmolLM2's) is
also kept in torch's packed int4 layout (`pack_int4`): a decode step streams every
weight from memory once, and a quarter of the bytes makes the small-batch steps of
a bfloat16 model up to 2x faster (`LlamaForCausalLM.prepack` routes by row count).
"""

from __future__ import annotations

from typing import NamedTuple

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


class Int4Weight(NamedTuple):
    """A weight on a 4-bit grid in torch's packed int4 layout: w = (q - 8) * scale + zero
    per `group` inputs of each output row (what `pack_int4` recovered)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [in / group, out, 2], the activations' dtype
    group: int


INT4_GROUP = 32  # the block of GGUF's Q4_0 / Q4_1 (and Q5 and Q8) formats


def pack_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight | None:
    """`weight` ([out, in], bfloat16, CPU) in 4-bit form, or None where it is not one.

    A checkpoint quantized to 4 bits (a Q4_1 GGUF, dequantized at load) holds in every
    group of 32 inputs at most 16 values, evenly spaced from the group's minimum to its
    maximum. Those are recovered (scale = (max - min) / 15, zero point = min) and the
    weight is kept as int4 only where every value lies on its group's grid within the
    dtype's rounding: a weight that was never 4-bit (any trained or random float one)
    fails at once, so this never quantizes a model, it only stores one compactly.

    Only bfloat16: torch's int4 kernel is vectorized for it, scalar for float32."""
    out, inp = weight.shape
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or inp % group:
        return None
    # The int4 layout's tiles are 16 outputs wide, and older torch builds lack the kernel.
    if out % 16 or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    # The first 16 rows first: most weights fail there, before a pass over the whole.
    if _on_grid(weight[:16], group) is None:
        return None
    grid = _on_grid(weight, group)
    if grid is None:
        return None
    q, scale, lo = grid
    scale, lo = scale.squeeze(-1), lo.squeeze(-1)
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1).to(weight.dtype).contiguous()
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        packed_w = Int4Weight(packed, sz, group)
        # One trial call: a build whose kernel cannot run this shape fails here, not mid-step.
        linear_int4(torch.zeros(1, inp, dtype=weight.dtype, device="cpu"), packed_w, None)
    except RuntimeError:
        return None
    return packed_w


def _on_grid(
    weight: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(levels 0..15, scale, minimum) per group, or None where a value is off its grid."""
    w = weight.detach().float().view(weight.shape[0], -1, group)
    lo = w.amin(-1, keepdim=True)
    scale = (w.amax(-1, keepdim=True) - lo) / 15
    q = torch.round((w - lo) / torch.where(scale > 0, scale, 1.0)).clamp_(0, 15)
    # On the grid: off by under 1/20 of a step, or by the input's own bfloat16 rounding.
    err = (q * scale + lo - w).abs_()
    if not bool((err <= scale * 0.05 + w.abs() * 2**-7).all()):
        return None
    return q.view(weight.shape), scale, lo


def linear_int4(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias with W from `pack_int4`; x: [rows, in] in the weight's dtype."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group, w.scales_zeros)
    return y if bias is None else y + bias
