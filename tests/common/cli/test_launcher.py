"""`pdserve up`'s process handling with stand-in node commands (no engine): ready detection,
a node that dies at start-up (its log tail in the error), stop by SIGTERM then SIGKILL, and
the node command lines it plans; restarting a node that exits while serving."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

import pytest

from common.cli.main import build_parser
from common.cli.up import (
    LaunchError,
    NodeProcess,
    UpConfig,
    engine_flags,
    plan_nodes,
    supervise,
)

READY = "print('pdserve node ready: http://127.0.0.1:1', flush=True)"


def _node(tmp_path: Path, code: str, name: str = "n") -> NodeProcess:
    argv = [sys.executable, "-c", code]
    return NodeProcess(name, "prefill", argv, "http://127.0.0.1:9", tmp_path / f"{name}.log")


@pytest.mark.e2e
def test_a_node_is_ready_on_its_ready_line_and_stops_on_sigterm(tmp_path: Path) -> None:
    async def body() -> None:
        node = _node(tmp_path, f"import time; {READY}; time.sleep(60)")
        await node.start()
        try:
            await node.wait_ready(10.0)
        finally:
            await node.stop(5.0)
        assert node.exited() and node.ready
        assert "pdserve node ready" in (tmp_path / "n.log").read_text()

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.e2e
def test_a_node_started_on_port_0_is_found_at_the_port_its_ready_line_names(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        argv = [sys.executable, "-c", f"import time; {READY}; time.sleep(60)", "--port", "0"]
        node = NodeProcess("n", "prefill", argv, "", tmp_path / "n.log")
        await node.start()
        try:
            await node.wait_ready(10.0)
        finally:
            await node.stop(5.0)
        assert node.url == "http://127.0.0.1:1"
        assert node.argv[-2:] == ["--port", "1"]  # a restart comes back at the same address

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.e2e
def test_a_node_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    code = f"{ignore}; {READY}; time.sleep(60)"

    async def body() -> None:
        node = _node(tmp_path, code)
        await node.start()
        await node.wait_ready(10.0)
        await node.stop(0.5)
        assert node.exited()

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.e2e
def test_a_node_that_dies_at_start_fails_the_launch_with_its_log_tail(tmp_path: Path) -> None:
    async def body() -> None:
        node = _node(tmp_path, "import sys; print('boom: bad flag'); sys.exit(3)", "bad")
        await node.start()
        try:
            with pytest.raises(LaunchError) as err:
                await node.wait_ready(10.0)
        finally:
            await node.stop(1.0)
        message = str(err.value)
        assert "bad" in message and "status 3" in message and "boom: bad flag" in message

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.e2e
def test_a_node_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    async def body() -> None:
        node = _node(tmp_path, "import time; print('loading', flush=True); time.sleep(60)")
        await node.start()
        try:
            with pytest.raises(LaunchError, match="not ready after 0.5 s"):
                await node.wait_ready(0.5)
        finally:
            await node.stop(1.0)

    asyncio.run(asyncio.wait_for(body(), 30))


def test_node_command_lines(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["up", "--prefill", "2", "--num-blocks", "64", "--kv-backend", "zmq", "--model", "M"]
    )
    assert isinstance(args, argparse.Namespace)
    assert engine_flags(args) == ["--num-blocks", "64"]
    switched = build_parser().parse_args(["up", "--no-prefix-caching", "--model", "M"])
    assert engine_flags(switched) == ["--no-prefix-caching"]  # a switch passes on bare
    cfg = UpConfig(model="M", prefill=2, kv_backend="zmq", node_args=tuple(engine_flags(args)))
    nodes = plan_nodes(cfg, tmp_path)
    assert [n.name for n in nodes] == ["prefill-0", "prefill-1", "decode-0"]
    # Each node binds port 0 and names its port on its ready line (no pick-then-release race).
    assert all(n.url == "" and n.argv[n.argv.index("--port") + 1] == "0" for n in nodes)
    argv = nodes[2].argv
    assert argv[1:6] == ["-m", "common.cli", "node", "--role", "decode"]
    for flag, value in (("--model", "M"), ("--threads", "1"), ("--kv-backend", "zmq")):
        assert argv[argv.index(flag) + 1] == value
    assert argv[-2:] == ["--num-blocks", "64"]
    both = plan_nodes(UpConfig(model="M", colocated=1), tmp_path)
    assert [n.role for n in both] == ["both"]
    with pytest.raises(ValueError):
        UpConfig(model="M", decode=0)


def test_per_role_node_flags_reach_only_that_role_and_win_over_the_common_ones(
    tmp_path: Path,
) -> None:
    args = build_parser().parse_args(
        ["up", "--model", "M", "--num-blocks", "64", "--prefill-node-args", "--num-blocks 8"]
    )
    assert isinstance(args, argparse.Namespace)
    cfg = UpConfig(
        model="M",
        node_args=tuple(engine_flags(args)),
        prefill_node_args=tuple(shlex.split(args.prefill_node_args)),
        decode_node_args=("--max-num-seqs", "4"),
    )
    prefill, decode = plan_nodes(cfg, tmp_path)
    engine = build_parser().parse_args(["node", "--role", "prefill", *prefill.argv[6:]])
    assert engine.num_blocks == 8  # the last --num-blocks is the one argparse keeps
    assert "--max-num-seqs" not in prefill.argv
    assert decode.argv[-4:] == ["--num-blocks", "64", "--max-num-seqs", "4"]


def test_pin_cores_gives_each_node_its_own_cores(tmp_path: Path) -> None:
    ours = sorted(os.sched_getaffinity(0))
    cfg = UpConfig(model="M", prefill=1, decode=1, pin_cores=len(ours) >= 2)
    if len(ours) >= 2:
        assert cfg.node_cpus() == [frozenset(ours[:1]), frozenset(ours[1:2])]
    nodes = plan_nodes(
        UpConfig(model="M", colocated=1, threads_per_node=len(ours), pin_cores=True), tmp_path
    )
    assert [n.cpus for n in nodes] == [frozenset(ours)]
    assert plan_nodes(UpConfig(model="M"), tmp_path)[0].cpus is None
    with pytest.raises(ValueError, match="--pin-cores needs"):
        UpConfig(model="M", colocated=1, threads_per_node=len(ours) + 1, pin_cores=True)


@pytest.mark.e2e
def test_a_pinned_node_runs_on_its_cores(tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    code = f"import os; print('cpus', sorted(os.sched_getaffinity(0)), flush=True); {READY}"

    async def body() -> None:
        node = NodeProcess(
            "pinned",
            "prefill",
            [sys.executable, "-c", code],
            "http://127.0.0.1:9",
            tmp_path / "pinned.log",
            frozenset({core}),
        )
        await node.start()
        try:
            await node.wait_ready(10.0)
        finally:
            await node.stop(5.0)
        assert f"cpus [{core}]" in (tmp_path / "pinned.log").read_text()

    asyncio.run(asyncio.wait_for(body(), 30))


def _flaky(tmp_path: Path, crashes: int) -> str:
    """A stand-in node that gets ready, then exits with status 7 on its first `crashes` runs
    (counted in a file) and stays up after that."""
    runs = tmp_path / "runs"
    return (
        "import pathlib, sys, time\n"
        f"f = pathlib.Path({str(runs)!r})\n"
        "n = int(f.read_text()) if f.exists() else 0\n"
        "f.write_text(str(n + 1))\n"
        f"{READY}\n"
        f"if n < {crashes}:\n"
        "    time.sleep(0.2)\n"
        "    sys.exit(7)\n"
        "time.sleep(60)\n"
    )


@pytest.mark.e2e
def test_a_node_that_exits_while_serving_is_restarted(tmp_path: Path) -> None:
    cfg = UpConfig(model="M", max_restarts=3, restart_backoff_s=0.05)

    async def body() -> None:
        node = _node(tmp_path, _flaky(tmp_path, crashes=2))
        await node.start()
        await node.wait_ready(10.0)
        supervisor = asyncio.ensure_future(supervise(cfg, [node], poll_s=0.05))
        try:
            while (tmp_path / "runs").read_text() != "3" or not node.ready:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the third run stays up
            assert not node.exited() and node.restarts == 2
        finally:
            supervisor.cancel()
            await node.stop(5.0)
        # One log across restarts: every run's output is kept.
        assert (tmp_path / "n.log").read_text().count("pdserve node ready") == 3

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.e2e
def test_a_node_that_keeps_exiting_is_left_down_after_max_restarts(tmp_path: Path) -> None:
    cfg = UpConfig(model="M", max_restarts=2, restart_backoff_s=0.05)

    async def body() -> None:
        node = _node(tmp_path, _flaky(tmp_path, crashes=100))
        await node.start()
        await node.wait_ready(10.0)
        supervisor = asyncio.ensure_future(supervise(cfg, [node], poll_s=0.05))
        try:
            while not node.stopping:  # set when the supervisor gives up on it
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert node.exited() and node.returncode == 7
            assert node.restarts == 2 and (tmp_path / "runs").read_text() == "3"
        finally:
            supervisor.cancel()
            await node.stop(5.0)

    asyncio.run(asyncio.wait_for(body(), 30))
