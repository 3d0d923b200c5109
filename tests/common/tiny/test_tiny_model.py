"""The built-in tiny model: deterministic bytes, multi-byte merges, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

import common.tiny.model as tiny_model
from common.text.tokenizer import Tokenizer
from common.tiny.model import MODEL_VERSION, default_cache_root, default_model_dir, train_bpe
from tests.support import procs

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.mark.e2e
@pytest.mark.slow
def test_identical_bytes_across_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    code = "import sys; from common.tiny.model import make_tiny_model; make_tiny_model(sys.argv[1])"
    runs: list[procs.Proc] = []
    try:
        for seed in (1, 2):  # at the same time, with different hash seeds
            argv = procs.python("-c", code, str(tmp_path / f"run{seed}"))
            env = procs.child_env(PYTHONHASHSEED=str(seed))
            runs.append(procs.spawn(f"run{seed}", argv, tmp_path / f"run{seed}.log", env=env))
        assert [p.wait(timeout=120) for p in runs] == [0, 0], [p.log_tail() for p in runs]
    finally:
        procs.stop_all(runs)
    first = digests(tmp_path / "run1")
    assert set(first) == EXPECTED_FILES
    assert first == digests(tmp_path / "run2") == digests(tiny_model_dir)


def test_train_bpe_breaks_ties_by_symbol_order() -> None:
    assert train_bpe({"ab": 1, "cd": 1, "xy": 5}, 10, min_frequency=1) == [
        ("x", "y"),
        ("a", "b"),
        ("c", "d"),
    ]
    assert train_bpe({"aaaa": 2}, 10) == [("a", "a"), ("aa", "aa")]


def test_config(tiny_model_dir: Path, tiny_tokenizer: Tokenizer) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == 256 and cfg["intermediate_size"] == 768
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 64 and cfg["num_hidden_layers"] == 4
    assert cfg["vocab_size"] % 64 == 0
    assert tiny_tokenizer.vocab_size <= cfg["vocab_size"] < tiny_tokenizer.vocab_size + 64
    assert 2000 <= tiny_tokenizer.vocab_size <= 4000
    assert cfg["eos_token_id"] == tiny_tokenizer.eos_token_ids == [2, 4]


def test_vocab_has_multibyte_merges(tiny_tokenizer: Tokenizer) -> None:
    """Merged tokens cover whole multi-byte characters (2, 3 and 4 bytes) and parts of them."""
    merged = range(5 + 256, tiny_tokenizer.vocab_size)  # after specials and byte symbols
    texts = [tiny_tokenizer.decode([i]) for i in merged]
    whole = [t for t in texts if "\ufffd" not in t]
    widths = {len(c.encode()) for t in whole for c in t}
    assert {2, 3, 4} <= widths
    assert any("\ufffd" in t for t in texts)  # a merge ending inside a character
    for word in ("你好", "Привет", "😀"):
        ids = tiny_tokenizer.encode(word, add_special_tokens=False)
        assert len(ids) < len(word.encode()), word


def test_transformers_loads_model_and_tokenizer(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), output_loading_info=True
    )
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.dtype == torch.float32
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = hf_tok("Hello, 世界")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()
    top2 = logits[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).max() > 0.1  # logits are not flat


def test_default_model_dir_generates_once(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = default_model_dir()
    assert first == tmp_path / MODEL_VERSION
    assert digests(first) == digests(tiny_model_dir)

    def fail(_: Any) -> Path:
        raise AssertionError("regenerated a cached model")

    monkeypatch.setattr(tiny_model, "make_tiny_model", fail)
    assert default_model_dir() == first
    assert [p.name for p in tmp_path.iterdir()] == [MODEL_VERSION]  # no temp dirs left


def test_default_model_dir_lost_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process renames its copy into place while we generate: we use theirs."""
    target = tmp_path / MODEL_VERSION

    def competitor_wins(out: Path) -> Path:
        target.mkdir()
        (target / "config.json").write_text("theirs")
        (Path(out) / "config.json").write_text("ours")
        return Path(out)

    monkeypatch.setattr(tiny_model, "make_tiny_model", competitor_wins)
    assert default_model_dir(tmp_path) == target
    assert (target / "config.json").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == [MODEL_VERSION]


def test_default_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_root() == tmp_path / "pdserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_root() == tmp_path / ".cache" / "pdserve"
