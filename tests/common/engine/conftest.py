"""Engines over a tiny random Llama checkpoint, for the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint: Any) -> Path:
    return hf_checkpoint("llama").path


@pytest.fixture
def make_engine(model_dir: Path) -> Callable[..., LLMEngine]:
    """`make_engine(**config)`: an engine of 64 blocks unless told otherwise."""

    def make(**kw: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model_dir), **{"num_blocks": 64, **kw}))

    return make
