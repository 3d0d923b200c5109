"""4-bit weights kept in torch's int4 layout (kernels/cpu_linear.pack_int4) against the
dense bfloat16 weight they came from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear

gguf_quants = pytest.importorskip("gguf.quants")
Q = pytest.importorskip("gguf").GGMLQuantizationType


def _q4_1(out: int, inp: int, seed: int) -> torch.Tensor:
    """A [out, in] weight as a Q4_1 GGUF stores it, dequantized (llama.cpp's own format)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, inp)).astype(np.float32) * 0.05
    data = gguf_quants.quantize(w, Q.Q4_1)
    return torch.from_numpy(gguf_quants.dequantize(data, Q.Q4_1).reshape(out, inp).copy())


def _available() -> bool:
    return cpu_linear.pack_int4(_q4_1(16, 32, 0).bfloat16()) is not None


pytestmark = pytest.mark.skipif(not _available(), reason="no int4 CPU kernel for bfloat16 here")


@pytest.mark.parametrize("rows", [1, 5, 12, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_a_q4_1_weight_is_recovered_and_computes_what_the_dense_one_does(
    rows: int, bias: bool
) -> None:
    w = _q4_1(96, 160, rows).bfloat16()
    w4 = cpu_linear.pack_int4(w)
    assert w4 is not None and w4.group == 32
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    got = cpu_linear.linear_int4(x, w4, b).float()
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    # bfloat16 output rounding (and scale/zero points in bfloat16): the dense path's error
    dense = F.linear(x, w, b).float()
    tol = (dense - want).abs().max().item() * 2 + 1e-3
    assert (got - want).abs().max().item() <= tol


def test_weights_that_were_never_4_bit_are_refused() -> None:
    g = torch.Generator().manual_seed(0)
    assert cpu_linear.pack_int4(torch.randn(64, 64, generator=g).bfloat16()) is None
    # Q8_0 has 256 levels a group: not 4-bit either
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    q8 = gguf_quants.dequantize(gguf_quants.quantize(w, Q.Q8_0), Q.Q8_0).reshape(64, 64)
    assert cpu_linear.pack_int4(torch.from_numpy(q8.copy()).bfloat16()) is None


def test_one_value_off_the_grid_refuses_the_whole_weight() -> None:
    w = _q4_1(32, 64, 3)
    assert cpu_linear.pack_int4(w.bfloat16()) is not None
    grid = w.view(32, 2, 32)
    lo, hi = grid.amin(-1), grid.amax(-1)
    w[5, 40] = (lo[5, 1] + (hi[5, 1] - lo[5, 1]) * (6.5 / 15)).item()  # between two levels
    assert cpu_linear.pack_int4(w.bfloat16()) is None


def test_shapes_and_dtypes_the_layout_cannot_hold_are_refused() -> None:
    assert cpu_linear.pack_int4(_q4_1(32, 64, 4)) is None  # float32: no vectorized kernel
    assert cpu_linear.pack_int4(_q4_1(24, 64, 5).bfloat16()) is None  # outputs not 16-wide
    w = _q4_1(32, 64, 6).bfloat16()[:, :48]  # inputs not whole groups
    assert cpu_linear.pack_int4(w.contiguous()) is None
