"""Fixtures: real node processes on loopback, one set per backend.

`trio` (prefill, decode1, decode2) is started once per backend and reused by
every test of that backend; each test starts fresh agents inside it. Tests that
SIGKILL a node start their own victim process. All processes are stopped in
finally blocks, also when a test fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kv_transfer.config import BACKENDS
from tests.support.kv_agents import AgentNode, start_nodes


@dataclass
class Trio:
    backend: str
    prefill: AgentNode
    decode1: AgentNode
    decode2: AgentNode


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv_nodes")


@pytest.fixture(scope="session")
def trio(backend: str, log_dir: Path) -> Iterator[Trio]:
    nodes = start_nodes([f"{backend}-prefill", f"{backend}-decode1", f"{backend}-decode2"], log_dir)
    try:
        yield Trio(backend, *nodes)
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def victim(backend: str, log_dir: Path) -> Iterator[AgentNode]:
    """A fresh process the test may SIGKILL."""
    (node,) = start_nodes([f"{backend}-victim-{uuid.uuid4().hex[:6]}"], log_dir)
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def shm_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"pdkv-test-{uuid.uuid4().hex}"
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
