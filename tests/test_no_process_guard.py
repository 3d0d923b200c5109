"""The fast tier starts no process: tests/conftest.py makes every way of starting one fail
in a test not marked e2e, in its fixtures too (of any scope), and lets e2e tests through."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ProcessInFastTest
from tests.support import procs


@pytest.fixture(scope="module")
def spawned_by_module_fixture() -> BaseException | None:
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=30)
    except ProcessInFastTest as e:
        return e
    return None


def test_a_module_fixture_of_a_fast_test_cannot_start_a_process(
    spawned_by_module_fixture: BaseException | None,
) -> None:
    assert isinstance(spawned_by_module_fixture, ProcessInFastTest)
    assert "is not marked e2e" in str(spawned_by_module_fixture)


def test_subprocess_and_the_harness_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ProcessInFastTest, match=r"test_no_process_guard.py::.* not marked e2e"):
        subprocess.run([sys.executable, "-c", "pass"], timeout=30)
    with pytest.raises(ProcessInFastTest):
        subprocess.Popen(["true"])
    with pytest.raises(ProcessInFastTest):
        procs.run(procs.python("-c", "pass"), timeout=30)
    with pytest.raises(ProcessInFastTest):
        procs.spawn("x", procs.python("-c", "pass"), tmp_path / "x.log")
    with pytest.raises(ProcessInFastTest):
        os.system("true")


def test_asyncio_subprocesses_are_refused() -> None:
    async def body() -> None:
        with pytest.raises(ProcessInFastTest):
            await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        with pytest.raises(ProcessInFastTest):
            await asyncio.create_subprocess_shell("true")

    asyncio.run(body())


def test_multiprocessing_is_refused() -> None:
    proc = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(ProcessInFastTest):
        proc.start()
    assert proc.pid is None


@pytest.mark.e2e
def test_an_e2e_test_may_start_processes() -> None:
    assert procs.run(procs.python("-c", "print(6 * 7)"), timeout=60).stdout == "42\n"
