"""LlamaForCausalLM.prepack: every linear layer swapped for a prepacked one, same outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.model.decoder import PackedLinear
from common.model.weights import load_model
from kernels import cpu_linear

pytestmark = pytest.mark.skipif(
    cpu_linear.pack(torch.zeros(2, 2)) is None, reason="no oneDNN linear in this torch build"
)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied; tied with q/k/v bias
def test_prepack_swaps_every_linear_and_keeps_outputs(hf_checkpoint, arch: str) -> None:
    ckpt = hf_checkpoint(arch)
    plain, h1 = load_model(ckpt.path, "float32", prepack=False)
    packed, h2 = load_model(ckpt.path, "float32")
    assert h1 == h2
    layers = plain.config.num_layers
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 4 * layers + 1
    # The embedding is still a real parameter (the LM head's packed copy is separate).
    assert isinstance(packed.model.embed_tokens.weight, nn.Parameter)
    pairs = [
        (plain.lm_head, packed.lm_head),
        *(
            (getattr(a, n), getattr(b, n))
            for la, lb in zip(plain.model.layers, packed.model.layers, strict=True)
            for a, b, n in [
                (la.self_attn, lb.self_attn, "qkv_proj"),
                (la.self_attn, lb.self_attn, "o_proj"),
                (la.mlp, lb.mlp, "gate_up_proj"),
                (la.mlp, lb.mlp, "down_proj"),
            ]
        ),
    ]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for a, b in pairs:
            x = torch.randn(5, a.in_features, generator=g)
            torch.testing.assert_close(b(x), a(x))


def _q4_grid(out: int, inp: int) -> torch.Tensor:
    """A bfloat16 weight whose every group of 32 inputs holds 16 evenly spaced levels."""
    g = torch.Generator().manual_seed(out)
    q = torch.randint(0, 16, (out, inp // 32, 32), generator=g).float()
    scale = torch.rand(out, inp // 32, 1, generator=g) * 0.01 + 1e-3
    lo = -8 * scale + torch.randn(out, inp // 32, 1, generator=g) * 1e-3
    q[..., 0], q[..., 1] = 0, 15  # every level range spans its group, as Q4_1's does
    return (q * scale + lo).view(out, inp).bfloat16()


@pytest.mark.skipif(
    cpu_linear.pack_int4(_q4_grid(16, 32)) is None, reason="no bfloat16 int4 kernel here"
)
def test_a_4_bit_weight_runs_small_batches_in_int4_and_large_ones_dense() -> None:
    w = _q4_grid(64, 96)
    dense, w4 = cpu_linear.pack(w), cpu_linear.pack_int4(w)
    assert dense is not None and w4 is not None
    layer = PackedLinear(dense, None, w4)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, PackedLinear.int4_max_rows, PackedLinear.int4_max_rows + 1, 40):
            x = torch.randn(rows, 96, generator=g).bfloat16()
            want = (
                cpu_linear.linear_int4(x, w4, None)
                if rows <= PackedLinear.int4_max_rows
                else cpu_linear.linear(x, dense, None)
            )
            assert torch.equal(layer(x), want)
            torch.testing.assert_close(layer(x), F.linear(x, w), atol=0.02, rtol=0.02)
