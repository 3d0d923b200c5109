"""LlamaForCausalLM.prepack: every linear layer swapped for a prepacked one, same outputs."""

from __future__ import annotations

import pytest
import torch
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
