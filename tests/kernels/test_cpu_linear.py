"""Prepacked oneDNN linear layers (kernels/cpu_linear.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear

pytestmark = pytest.mark.skipif(
    cpu_linear.pack(torch.zeros(2, 2)) is None, reason="no oneDNN linear in this torch build"
)


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    packed = cpu_linear.pack(w)
    assert packed is not None
    torch.testing.assert_close(cpu_linear.linear(x, packed, b), F.linear(x, w, b))


def test_leading_dims_and_inference_mode() -> None:
    w = torch.randn(8, 16)
    packed = cpu_linear.pack(w)
    assert packed is not None
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        out = cpu_linear.linear(x, packed, None)
    torch.testing.assert_close(out, F.linear(x, w))


def test_pack_copies_the_weight() -> None:
    w = torch.randn(8, 16)
    packed = cpu_linear.pack(w)
    assert packed is not None
    x = torch.randn(3, 16)
    before = cpu_linear.linear(x, packed, None)
    w.zero_()  # the packed copy is independent of the source tensor
    torch.testing.assert_close(cpu_linear.linear(x, packed, None), before)


def test_a_dtype_this_cpu_cannot_run_is_refused_not_crashed() -> None:
    # bfloat16 packs only on CPUs with AVX-512 or AVX-NE-CONVERT; elsewhere pack says None.
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    packed = cpu_linear.pack(w)
    if packed is not None:
        x = torch.randn(3, 16, dtype=torch.bfloat16)
        out = cpu_linear.linear(x, packed, None).float()
        torch.testing.assert_close(out, F.linear(x, w).float(), atol=0.05, rtol=0.02)
