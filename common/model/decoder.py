"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

Token-in / hidden-out: `forward` takes a flat batch of token ids and positions
plus `AttentionMetadata`; `compute_logits` projects only the rows that sample.
q/k/v and gate/up projections are fused at load time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from common.model.attention import AttentionMetadata, paged_attention
from common.model.config import ModelConfig, RopeScaling
from kernels import cpu_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        # device=None: the default device, meta while load_model builds the model
        self.weight = nn.Parameter(torch.ones(dim, device=None))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: normalised in float32, cast back, then scaled, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class PackedLinear(nn.Module):
    """A linear layer whose weight lives only in oneDNN's prepacked layout (CPU), and,
    where the weight is 4-bit already, also in torch's int4 layout for small batches."""

    # Up to this many rows (a decode step's batch), the int4 copy: a quarter of the
    # weight bytes to stream, but the kernel's cost grows with the rows, and from ~16
    # it is slower than oneDNN's bfloat16 (kernels/cpu_linear.py; bench_engine.py).
    int4_max_rows = 12

    def __init__(
        self,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        int4: cpu_linear.Int4Weight | None = None,
    ) -> None:
        super().__init__()
        self.packed = packed  # opaque layout: a plain attribute, not a parameter
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.int4 = int4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= self.int4_max_rows:
            return cpu_linear.linear_int4(x, self.int4, self.bias)
        return cpu_linear.linear(x, self.packed, self.bias)


def _inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: str | torch.device
) -> torch.Tensor:
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv = 1.0 / (theta ** (steps / head_dim))
    if scaling is None:
        return inv
    # Llama-3: keep high frequencies, divide low ones by `factor`, blend between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled)


class RotaryEmbedding:
    """Non-interleaved (rotate-half) RoPE with a float32 cos/sin table.

    A plain object, not a module: dtype casts of the model must not touch the table.
    `table(positions)` is looked up once per forward and shared by every layer.
    """

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu") -> None:
        # Computed on the host, then moved: the same table bits whatever the device.
        inv = _inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, "cpu")
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv)  # [max_pos, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        # rotate_half(x) * sin == roll(x, half) * signed_sin: one roll, no negation per call.
        sin = emb.sin()
        half = sin.shape[-1] // 2
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for `positions` ([T]), each [T, 1, head_dim] float32."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [T, heads, head_dim] (q and k heads side by side) rotated by `table`."""
    cos, signed_sin = table
    xf = x.float()
    rot = torch.roll(xf, xf.shape[-1] // 2, dims=-1)
    return torch.addcmul(xf * cos, rot, signed_sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k sit side by side: one rotation for both.
        qk = apply_rope(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, kv_cache, self.layer, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Given its (uninitialized) weight, Embedding skips its random init: on the meta
        # device, normal_ goes through torch._refs, whose first import costs ~3 s.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size, device=torch.get_default_device())
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _on_meta() -> bool:
    return torch.get_default_device().type == "meta"


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM checkpoints."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rope = RotaryEmbedding(cfg, "meta" if _on_meta() else "cpu")
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepack(self, int4: bool = True) -> int:
        """Swap every linear layer for a prepacked one where this CPU supports it
        (kernels/cpu_linear.py); returns how many were swapped. Call once, after
        the weights are loaded: the plain weights of swapped layers are dropped
        (the tied embedding stays, and the LM head gets a packed copy of it).
        int4: also keep an int4 copy of each weight that is 4-bit already."""
        swapped = 0
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                packed = cpu_linear.pack(child.weight)
                if packed is None:
                    return swapped  # same dtype and device throughout: none will pack
                q4 = cpu_linear.pack_int4(child.weight) if int4 else None
                setattr(parent, name, PackedLinear(packed, child.bias, q4))
                swapped += 1
        return swapped

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rope.table(positions)
        for layer in self.model.layers:
            x = layer(x, rope, kv_cache, meta)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
