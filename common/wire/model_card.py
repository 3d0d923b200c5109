"""What the proxy and the nodes agree the model is, read from a model directory's config.json.

The proxy validates requests against it without loading the model (it never imports
`common.model`); the engine's `ModelConfig` derives the same numbers from the same rules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_CONTEXT_LENGTH = 2048


def context_length(cfg: dict[str, Any]) -> int:
    """The longest sequence the model serves: `max_position_embeddings`, capped by a sliding
    window (no sliding-window attention here: serve only what full attention gets right)."""
    max_pos = int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and int(window) < max_pos:
        return int(window)
    return max_pos


def read_context_length(model_dir: str | Path) -> int:
    """`context_length` of the model directory's config.json; FileNotFoundError if it has none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    return context_length(json.loads(path.read_text()))
