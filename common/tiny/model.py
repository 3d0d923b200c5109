"""The built-in default model: a small Llama with seeded weights and a locally trained tokenizer.

``make_tiny_model(dir)`` writes an HF-layout model directory (config, generation config,
safetensors weights, tokenizer.json, tokenizer config with a ChatML chat template) that
``transformers`` loads as ``LlamaForCausalLM`` / ``PreTrainedTokenizerFast``.  Nothing is
downloaded: the tokenizer is a byte-level BPE trained here on ``tiny_corpus.CORPUS`` by a small
deterministic trainer (``train_bpe``), and the weights come from a seeded ``torch.Generator``.

Contract: the output is a pure function of this file and the corpus.  Every file is
byte-identical across runs and processes (whatever ``PYTHONHASHSEED``): JSON is written with
sorted keys or in a fixed order, the BPE trainer breaks ties by symbol order, and the
safetensors header is fixed.  Any change to the output must bump ``MODEL_VERSION`` so that
cached copies (``default_model_dir``) are regenerated.
"""

from __future__ import annotations

import heapq
import json
import os
import shutil
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

from common.tiny.corpus import CORPUS

MODEL_VERSION = "tiny-llama-v1"
SEED = 20240601

UNK, BOS, EOS, IM_START, IM_END = "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS, IM_START, IM_END)  # ids 0..4
TOKENIZER_VOCAB_SIZE = 2816  # specials + 256 byte symbols + merges; a multiple of 64

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is not string %}"
    "{{ raise_exception('Only string message content is supported.') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaShape:
    """Architecture of the built-in model (vocab_size is filled in from the tokenizer)."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# Init std per weight kind.  Large enough that logits are well separated (greedy argmax is not
# decided by float noise), small enough that the residual stream stays O(10).
EMBED_STD = 1.0
PROJ_STD = 0.08
LM_HEAD_STD = 0.15


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def train_bpe(
    word_counts: Mapping[str, int], max_new_tokens: int, min_frequency: int = 2
) -> list[tuple[str, str]]:
    """Learn BPE merges over the characters of ``word_counts``' keys.

    Repeatedly merges the most frequent adjacent symbol pair (ties: the smallest pair in code
    point order) until ``max_new_tokens`` distinct new symbols exist or no pair occurs
    ``min_frequency`` times.  The result depends only on the input, never on hash seeds or
    iteration order.
    """
    words = [list(w) for w in sorted(word_counts)]
    freqs = [word_counts[w] for w in sorted(word_counts)]
    counts: dict[tuple[str, str], int] = defaultdict(int)
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, symbols in enumerate(words):
        for pair in pairwise(symbols):
            counts[pair] += freqs[i]
            where[pair].add(i)
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    known = {s for symbols in words for s in symbols}
    new_tokens = 0
    while heap and new_tokens < max_new_tokens:
        neg_count, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -neg_count:
            continue  # stale heap entry
        if -neg_count < min_frequency:
            break
        merges.append(pair)
        if pair[0] + pair[1] not in known:
            known.add(pair[0] + pair[1])
            new_tokens += 1
        for changed in _apply_merge(pair, words, freqs, counts, where):
            heapq.heappush(heap, (-counts[changed], changed))
    return merges


def _apply_merge(
    pair: tuple[str, str],
    words: list[list[str]],
    freqs: list[int],
    counts: dict[tuple[str, str], int],
    where: dict[tuple[str, str], set[int]],
) -> set[tuple[str, str]]:
    """Merge ``pair`` in every word holding it; update pair counts; return the pairs touched."""
    touched: set[tuple[str, str]] = set()
    for i in sorted(where.pop(pair, ())):
        old = words[i]
        new = _merge_word(old, pair)
        if len(new) == len(old):
            continue
        for p in pairwise(old):
            counts[p] -= freqs[i]
            touched.add(p)
        for p in pairwise(new):
            counts[p] += freqs[i]
            where[p].add(i)
            touched.add(p)
        words[i] = new
    for p in touched:
        if counts[p] == 0:
            del counts[p]
    return {p for p in touched if p in counts}


def _merge_word(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def build_vocab(
    base_symbols: Iterable[str], merges: list[tuple[str, str]], specials: Iterable[str] = ()
) -> dict[str, int]:
    """Ids: specials first, then base symbols, then each merge's result in merge order."""
    vocab: dict[str, int] = {}
    for token in [*specials, *base_symbols, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    return vocab


def train_tiny_tokenizer(corpus: str | None = None) -> str:
    """Train the tiny model's byte-level BPE tokenizer; return its tokenizer.json text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    if corpus is None:
        corpus = CORPUS
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(corpus))
    base = [bytes_to_unicode()[b] for b in range(256)]
    budget = TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS) - len(base)
    merges = train_bpe(words, budget, min_frequency=2)
    vocab = build_vocab(base, merges, SPECIAL_TOKENS)

    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, vocab[BOS])],
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # Re-serialise for a stable layout: serde's field order, vocab in id order.
    return json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------
# Weights and files
# ---------------------------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def make_weights(shape: TinyLlamaShape, vocab_size: int, seed: int = SEED) -> dict:
    """LlamaForCausalLM state dict (float32), drawn in a fixed order from one seeded generator."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)  # written to disk: on the host

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32, device="cpu") * std

    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    inter = shape.intermediate_size
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, h, EMBED_STD)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = normal(h, h, PROJ_STD)
        w[f"{p}.self_attn.k_proj.weight"] = normal(kv, h, PROJ_STD)
        w[f"{p}.self_attn.v_proj.weight"] = normal(kv, h, PROJ_STD)
        w[f"{p}.self_attn.o_proj.weight"] = normal(h, h, PROJ_STD)
        w[f"{p}.mlp.gate_proj.weight"] = normal(inter, h, PROJ_STD)
        w[f"{p}.mlp.up_proj.weight"] = normal(inter, h, PROJ_STD)
        w[f"{p}.mlp.down_proj.weight"] = normal(h, inter, PROJ_STD)
        w[f"{p}.input_layernorm.weight"] = torch.ones(h, device="cpu")
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, device="cpu")
    w["model.norm.weight"] = torch.ones(h, device="cpu")
    w["lm_head.weight"] = normal(vocab_size, h, LM_HEAD_STD)
    return w


def _model_config(shape: TinyLlamaShape, vocab_size: int, eos_ids: list[int]) -> dict:
    fields = asdict(shape)
    return {
        **fields,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": eos_ids,
        "pad_token_id": SPECIAL_TOKENS.index(UNK),
    }


def _tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": TinyLlamaShape().max_position_embeddings,
        "pad_token": UNK,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
    }


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def make_tiny_model(out_dir: str | Path) -> Path:
    """Write the built-in model into ``out_dir`` (created if missing) and return it.

    Files: config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, special_tokens_map.json.  Deterministic: see the module docstring.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = train_tiny_tokenizer()
    n_tokens = len(json.loads(tokenizer_json)["model"]["vocab"])
    vocab_size = _round_up(n_tokens, 64)
    shape = TinyLlamaShape()
    eos_ids = [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)]

    (out / "tokenizer.json").write_text(tokenizer_json, "utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": UNK, "unk_token": UNK},
    )
    _write_json(out / "config.json", _model_config(shape, vocab_size, eos_ids))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": SPECIAL_TOKENS.index(BOS), "eos_token_id": eos_ids, "do_sample": False},
    )
    save_file(make_weights(shape, vocab_size), str(out / "model.safetensors"), {"format": "pt"})
    return out


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``."""
    if explicit := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(explicit)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "pdserve"
    return Path.home() / ".cache" / "pdserve"


def default_model_dir(cache_root: str | Path | None = None) -> Path:
    """Return the cached built-in model directory, generating it on first use.

    Safe under concurrency: the model is generated into a temporary directory beside the
    target and renamed into place; if another process wins the race, its copy is used.  A
    directory at the final path is therefore always complete.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / MODEL_VERSION
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_VERSION}.tmp-", dir=root))
    try:
        make_tiny_model(tmp)
        tmp.chmod(0o755)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m common.tiny.model [OUT_DIR]``: write the model there, or into the cache."""
    args = sys.argv[1:] if argv is None else argv
    out = make_tiny_model(args[0]) if args else default_model_dir()
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
