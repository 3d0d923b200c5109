"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.text.tokenizer import Tokenizer
from common.tiny.model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, generated once per test session (treat it as read-only)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    """The tiny model's tokenizer (byte-level BPE, ChatML template)."""
    return Tokenizer.from_dir(tiny_model_dir)


# -- an engine driver (used by the engine and model tests) ------------------------


class EngineDriver:
    """Steps an LLMEngine through its public surface, checking it after every step.

    Records each request's tokens and finish reason; asserts that nothing arrives
    for a finished request and that `check_integrity()` holds after every step.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, Any] = {}
        self.steps = 0

    def add(self, request_id: str, prompt: list[int], params: Any) -> None:
        self.engine.add_request(request_id, prompt, params)
        self.tokens[request_id] = []
        self.reasons.pop(request_id, None)

    def step(self) -> list[Any]:
        outputs = self.engine.step()
        self.steps += 1
        self.engine.check_integrity()
        for out in outputs:
            assert out.request_id in self.tokens, out
            assert out.request_id not in self.reasons, f"output after finish: {out}"
            self.tokens[out.request_id] += out.new_token_ids
            if out.finished:
                self.reasons[out.request_id] = out.finish_reason
        return outputs

    def finish(self, max_steps: int = 5000) -> dict[str, list[int]]:
        """Step until idle; assert every request finished and every block is free."""
        for _ in range(max_steps):
            if not self.engine.has_work():
                break
            self.step()
        else:
            raise AssertionError(f"engine still busy after {max_steps} steps")
        assert set(self.reasons) == set(self.tokens), "a request never finished"
        counts = self.engine.allocator.counts()
        assert counts["free"] == counts["total"], counts
        assert self.engine.state()["requests"] == {
            "waiting": 0,
            "running": 0,
            "held": 0,
            "reserved": 0,
        }
        return self.tokens


@pytest.fixture(scope="session")
def engine_driver() -> type[EngineDriver]:
    """`engine_driver(engine)` -> an EngineDriver (see its docstring)."""
    return EngineDriver
