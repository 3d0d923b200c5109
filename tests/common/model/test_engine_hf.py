"""The engine against transformers: greedy outputs token for token, and loading.

Tiny random checkpoints of each supported architecture (see `hf_checkpoint` in
conftest.py) are decoded by transformers `generate` one prompt at a time and by
the engine with every prompt in flight at once: plain, then with a KV pool so
small the scheduler must preempt and a token budget so small prompts are chunked.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.model.config import ModelLoadError
from common.wire.sampling_params import SamplingParams

ARCHS = ("llama", "qwen2", "mistral")
PROMPT_LENS = (1, 2, 7, 16, 17, 33, 100, 300)  # around block edges (16) and long
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_prompts(lens: tuple[int, ...], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


PROMPTS = make_prompts(PROMPT_LENS)


def hf_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    # min_new_tokens keeps EOS from ending the reference early (we ignore EOS).
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_reference(hf_checkpoint):
    """arch -> transformers greedy continuation of each prompt in PROMPTS (cached)."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            model = hf_checkpoint(arch).model
            cache[arch] = [hf_greedy(model, p) for p in PROMPTS]
        return cache[arch]

    return get


def run_all(engine: LLMEngine, driver_cls, prompts, params=GREEDY) -> list[list[int]]:
    """Add every prompt before the first step, step to completion, return outputs."""
    driver = driver_cls(engine)
    for i, p in enumerate(prompts):
        driver.add(str(i), p, params)
    tokens = driver.finish()
    assert all(r.value == "length" for r in driver.reasons.values()), driver.reasons
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_greedy_matches_transformers(arch, hf_checkpoint, hf_reference, engine_driver):
    ckpt = hf_checkpoint(arch)
    engine = LLMEngine(EngineConfig(model=str(ckpt.path), num_blocks=64, dtype="float32"))
    got = run_all(engine, engine_driver, PROMPTS)
    assert got == hf_reference(arch)
    assert engine.state()["preemptions"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_with_preemption_and_chunking(
    arch, hf_checkpoint, hf_reference, engine_driver
):
    ckpt = hf_checkpoint(arch)
    # 44 blocks of 8 tokens hold the 300-token prompt plus its outputs (39 blocks),
    # but nowhere near every prompt at once; 40 tokens per step chunks long prompts.
    config = EngineConfig(
        model=str(ckpt.path),
        num_blocks=44,
        block_size=8,
        max_num_batched_tokens=40,
        dtype="float32",
    )
    engine = LLMEngine(config)
    got = run_all(engine, engine_driver, PROMPTS)
    assert engine.state()["preemptions"] > 0
    assert got == hf_reference(arch)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])  # qwen2: tied embeddings in bf16
def test_bfloat16_runs_and_first_token_matches_transformers(arch, hf_checkpoint, engine_driver):
    # Full bf16 sequences do not reliably match transformers in bf16: HF applies
    # RoPE with cos/sin cast to bf16 while we rotate in float32, so near-tied
    # logits flip (with this seed one 33-token prompt differs from the first
    # token). So: check that bf16 runs end to end, and compare only the first
    # generated token of short prompts, and only where transformers' top-2 logit
    # margin is well above bf16 rounding noise.
    ckpt = hf_checkpoint(arch)
    hf_bf16 = copy.deepcopy(ckpt.model).to(torch.bfloat16)
    prompts = make_prompts((1, 2, 3, 5, 8), seed=2)
    engine = LLMEngine(EngineConfig(model=str(ckpt.path), num_blocks=16, dtype="bfloat16"))
    assert engine.kv_cache.dtype == torch.bfloat16 and engine.dtype == torch.bfloat16
    got = run_all(engine, engine_driver, prompts)
    assert all(len(t) == NEW_TOKENS and all(0 <= x < 512 for x in t) for t in got)
    compared = 0
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            logits = hf_bf16(torch.tensor([prompt])).logits[0, -1].float()
        top2 = logits.topk(2)
        if top2.values[0] - top2.values[1] > 0.25:
            assert tokens[0] == int(top2.indices[0]), prompt
            compared += 1
    assert compared >= 2, "too few well-separated prompts; pick another seed"


# -- loading -------------------------------------------------------------------


def copy_checkpoint(src: Path, dst: Path, *, weights: bool = True) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if weights or not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


def test_unsupported_architecture_fails_at_start(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("llama").path, tmp_path / "gpt2")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(path), num_blocks=8))


def test_missing_weights_fail_at_start(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("llama").path, tmp_path / "noweights", weights=False)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        LLMEngine(EngineConfig(model=str(path), num_blocks=8))


def test_missing_config_fails_at_start(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_blocks=8))


def test_missing_tensor_fails_at_start(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(hf_checkpoint("llama").path, tmp_path / "partial")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing tensors.*layers.1.mlp.gate_up_proj"):
        LLMEngine(EngineConfig(model=str(path), num_blocks=8))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.slow
def test_sharded_checkpoint_loads_identically(arch, hf_checkpoint, engine_driver):
    whole = hf_checkpoint(arch)
    sharded = hf_checkpoint(arch, max_shard_size="40KB")
    assert (sharded.path / "model.safetensors.index.json").is_file()
    assert len(list(sharded.path.glob("*.safetensors"))) > 2
    a = LLMEngine(EngineConfig(model=str(whole.path), num_blocks=32))
    b = LLMEngine(EngineConfig(model=str(sharded.path), num_blocks=32))
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    prompts = PROMPTS[:4]
    assert run_all(a, engine_driver, prompts) == run_all(b, engine_driver, prompts)


def test_missing_shard_fails_at_start(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("llama", max_shard_size="40KB").path, tmp_path / "s")
    shard = sorted(path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing.*{shard.name}"):
        LLMEngine(EngineConfig(model=str(path), num_blocks=8))
