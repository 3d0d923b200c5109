"""Shared pytest fixtures, and the guard that keeps the fast tier free of processes.

Tiers: `pytest -m "not e2e"` is the fast tier (in-process only); `pytest` runs everything.
A test that starts a process (a node, a proxy, a CLI command, a script) is marked `e2e`;
any other test that tries to start one fails at once (see `_processes_only_in_e2e_tests`).
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# On a fresh machine, matplotlib's first import runs `fc-list` to build its font cache: done
# here, before the guard below, rather than inside the first fast test that plots.
import matplotlib.font_manager  # noqa: F401
import pytest
import torch  # (its import runs `ldconfig -p`: done here, before the guard below)

from common.text.tokenizer import Tokenizer
from common.tiny.model import make_tiny_model
from tests.support import procs, schedule

# -- two workers, heaviest modules first (tests/support/schedule.py) ---------------------------


torch.set_num_threads(schedule.TORCH_THREADS)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture parameters
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    schedule.order_heaviest_first(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return schedule.make_scheduler(config, log)


# -- the fast tier starts no process -----------------------------------------------------------


class ProcessInFastTest(RuntimeError):
    """A test not marked e2e tried to start a process."""


# Every way to start a process that a test, a fixture or the code under test might take.
# Popen.__init__ also covers subprocess.run/check_output and asyncio's subprocess transports.
_SPAWNERS: list[tuple[object, str]] = [
    (subprocess.Popen, "__init__"),
    (asyncio, "create_subprocess_exec"),
    (asyncio, "create_subprocess_shell"),
    (asyncio.subprocess, "create_subprocess_exec"),
    (asyncio.subprocess, "create_subprocess_shell"),
    (multiprocessing.process.BaseProcess, "start"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
]


def _current_test() -> str | None:
    """The node id of the test pytest is setting up, running or tearing down (any fixture
    scope), from the PYTEST_CURRENT_TEST variable pytest maintains; None between tests."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.rsplit(" (", 1)[0] if current else None


def _guarded(owner: object, name: str, fast: frozenset[str]) -> Callable[..., Any]:
    original = getattr(owner, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        test = _current_test()
        if test in fast:
            where = f"{getattr(owner, '__name__', owner)}.{name}"
            shown = [a for a in args if not isinstance(a, subprocess.Popen)][:1]
            raise ProcessInFastTest(
                f"{test} is not marked e2e but tried to start a process ({where}"
                f"{'(' + repr(shown[0])[:200] + ', ...)' if shown else ''}). Mark it "
                "@pytest.mark.e2e (and slow if it takes long), or keep it in-process."
            )
        return original(*args, **kwargs)

    return guarded


@pytest.fixture(scope="session", autouse=True)
def _processes_only_in_e2e_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """For every test not marked e2e, starting a process raises ProcessInFastTest.

    Installed once for the session, so it also covers the fixtures a test sets up, of any
    scope; each call checks which test pytest is on. At the end, any process a test
    spawned through tests.support.procs and left running is killed and reported."""
    fast = frozenset(i.nodeid for i in request.session.items if not i.get_closest_marker("e2e"))
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in _SPAWNERS:
            if hasattr(owner, name):
                mp.setattr(owner, name, _guarded(owner, name, fast))
        yield
    leaked = procs.reap_all()
    assert not leaked, f"processes left running by tests, killed at session end: {leaked}"


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
