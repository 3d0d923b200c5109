"""What `--model` names: a local model directory, or the built-in default model."""

from __future__ import annotations

from common.tiny.model import default_model_dir


def model_dir(arg: str | None) -> str:
    """The `--model` directory, or the built-in default model (generated on first use)."""
    if arg:
        return arg
    return str(default_model_dir())
