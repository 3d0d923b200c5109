"""Load HF safetensors checkpoints (single file or sharded) into `LlamaForCausalLM`.

HF names map onto ours except that q/k/v and gate/up are fused: each HF tensor
is copied into its slice of the fused parameter.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from common.model.config import ModelConfig, ModelLoadError
from common.model.decoder import LlamaForCausalLM, RotaryEmbedding

log = logging.getLogger(__name__)

# HF suffix -> (our suffix, index of the slice in the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {model_dir} has no *.safetensors weights")
    return files


def _slices(cfg: ModelConfig, fused: str) -> list[tuple[int, int]]:
    if ".qkv_proj." in fused:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    i = cfg.intermediate_size
    return [(0, i), (i, 2 * i)]


def _target(name: str) -> tuple[str, int | None]:
    stem, _, kind = name.rpartition(".")  # kind: weight | bias
    for hf, (ours, idx) in _FUSED.items():
        if stem.endswith(hf):
            return f"{stem[: -len(hf)]}{ours}.{kind}", idx
    return name, None


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> str:
    """Copy every checkpoint tensor into `model`; return a hash of the weights.

    Raises ModelLoadError if a parameter of the model is missing from the checkpoint.
    """
    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    digest = hashlib.sha256()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                if "rotary_emb" in name:
                    continue
                ours, idx = _target(name)
                if ours not in params:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {path.name}")
                tensor = f.get_tensor(name)
                digest.update(name.encode())
                digest.update(tensor.flatten()[:1024].float().numpy().tobytes())
                digest.update(str(tuple(tensor.shape)).encode())
                param = params[ours]
                with torch.no_grad():
                    if idx is None:
                        _copy(param.data, tensor, name)
                    else:
                        lo, hi = _slices(cfg, ours)[idx]
                        _copy(param.data[lo:hi], tensor, name)
                filled.add(f"{ours}#{idx}")
    _check_complete(model, filled)
    return digest.hexdigest()[:16]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def _check_complete(model: LlamaForCausalLM, filled: set[str]) -> None:
    missing = []
    for name, _ in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            keys = [f"{name}#{i}" for i in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            keys = [f"{name}#{i}" for i in range(2)]
        else:
            keys = [f"{name}#None"]
        missing += [k for k in keys if k not in filled]
    if model.config.tie_word_embeddings:
        missing = [m for m in missing if not m.startswith("lm_head.")]
    if missing:
        raise ModelLoadError(f"checkpoint is missing tensors: {missing[:5]}")


def cpu_computes_bfloat16() -> bool | None:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX-BF16) on x86-64; None
    where torch cannot tell (another architecture, an older torch). Without it torch emulates
    bfloat16 and oneDNN will not pack its weights: on an AVX2-only EPYC (session 28), SmolLM2-
    135M on 2 threads prefilled 71 tokens/s in bfloat16 against 412 in float32, and decoded
    2.1x / 3.1x slower at batch 8 / 32 (1.3x faster at batch 1)."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:
        return None
    caps = capabilities()
    if caps.get("architecture") != "x86_64":
        return None
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_dtype(cfg: ModelConfig, dtype: str, device: str | torch.device = "cpu") -> torch.dtype:
    """`auto` keeps the checkpoint's dtype, except float16, which CPUs run poorly, and, on a
    CPU that has no bfloat16 arithmetic (`cpu_computes_bfloat16`), bfloat16, which it
    emulates (prefill ~6x slower than float32): both become float32 there. An explicit
    `bfloat16` on such a CPU is kept, with a warning."""
    name = cfg.torch_dtype if dtype == "auto" else dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float32}
    if name not in table:
        raise ModelLoadError(f"unsupported dtype {name!r}; use float32 or bfloat16")
    if (
        name == "bfloat16"
        and torch.device(device).type == "cpu"
        and cpu_computes_bfloat16() is False
    ):
        if dtype == "auto":
            log.warning(
                "the checkpoint is bfloat16 and this CPU has no bfloat16 arithmetic "
                "(AVX512-BF16 or AMX): running it in float32, which prefills ~6x faster here "
                "(--dtype bfloat16 forces bfloat16)"
            )
            return torch.float32
        log.warning(
            "--dtype bfloat16 on a CPU with no bfloat16 arithmetic (AVX512-BF16 or AMX): torch "
            "emulates it, and prefill runs ~6x slower than in float32 (--dtype float32 or auto "
            "avoids this)"
        )
    return table[name]


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer uninitialized storage on `device` (floating
    ones in `dtype`): what `to_empty(device).to(dtype)` does, without its `empty_like` of
    meta tensors, which goes through torch._refs and imports sympy (~0.8 s per process)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                           device=device)  # fmt: skip

    made: dict[int, nn.Parameter] = {}  # a parameter shared by two modules stays shared
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(empty(param), param.requires_grad)
                module._parameters[name] = made[id(param)]
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = empty(buf)


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    prepack: bool = True,
    int4: bool = True,
) -> tuple[LlamaForCausalLM, str]:
    """Build the model for `model_dir` and load its weights; returns (model, weights hash).

    prepack: on CPU, run the linear layers on oneDNN-prepacked weights where
    supported (LlamaForCausalLM.prepack); False keeps plain `nn.Linear`.
    int4: with prepack, weights that are 4-bit already also get an int4 copy."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(cfg, dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    _materialize(model, torch.device(device), torch_dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = RotaryEmbedding(cfg, device)
    weights_hash = load_weights(model, model_dir)
    if prepack and torch.device(device).type == "cpu":
        model.prepack(int4)
        if n4 := sum(getattr(m, "int4", None) is not None for m in model.modules()):
            log.info("%d linear layers are 4-bit: small batches run them in int4", n4)
    return model.eval(), weights_hash
