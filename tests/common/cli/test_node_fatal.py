"""A node whose engine thread or KV-transfer progress thread dies fails fast: /health says
503 and `serve` returns a non-zero status within a bound, so a supervisor restarts it
(in-process, no children)."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import aiohttp
import pytest

from common.cli.node import EXIT_NODE_FAILED, FATAL_STOP_TIMEOUT_S, serve
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.node.server import NodeConfig
from common.wire.node_messages import GenerateRequest, to_json
from common.wire.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from kv_transfer.progress import ProgressLoop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serving(http: aiohttp.ClientSession, url: str, node: asyncio.Future[int]) -> None:
    """Until the node's /health answers 200 (it must not exit first)."""
    while True:
        assert not node.done(), node
        try:
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)


def test_a_dead_engine_makes_the_node_exit_nonzero(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    boom = threading.Event()
    real_step = LLMEngine.step

    def step(self: LLMEngine):  # type: ignore[no-untyped-def]
        if boom.is_set():
            raise RuntimeError("injected engine fault")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    port = _free_port()
    engine = EngineConfig(model=str(tiny_model_dir), num_blocks=64, threads=1)
    config = NodeConfig(role="both", engine=engine, port=port)
    url = f"http://127.0.0.1:{port}"
    request = GenerateRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4)
    )

    async def body() -> int:
        node = asyncio.ensure_future(serve(config))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await _serving(http, url, node)
            boom.set()
            async with http.post(url + "/internal/generate", data=to_json(request)) as r:
                last = (await r.text()).splitlines()[-1]
            assert "engine" in last and '"error"' in last, last
        return await asyncio.wait_for(node, FATAL_STOP_TIMEOUT_S + 10)

    assert asyncio.run(asyncio.wait_for(body(), 120)) == EXIT_NODE_FAILED


def test_a_dead_transfer_thread_makes_the_node_exit_nonzero(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    boom = threading.Event()
    real_step = ProgressLoop._step

    def step(self: ProgressLoop, ready: dict) -> None:
        if boom.is_set():
            raise RuntimeError("injected progress-thread fault")
        real_step(self, ready)

    monkeypatch.setattr(ProgressLoop, "_step", step)
    port = _free_port()
    engine = EngineConfig(model=str(tiny_model_dir), num_blocks=64, threads=1)
    transfer = TransferConfig(backend="zmq")
    config = NodeConfig(role="prefill", engine=engine, port=port, transfer=transfer)
    url = f"http://127.0.0.1:{port}"

    async def body() -> tuple[int, int]:
        node = asyncio.ensure_future(serve(config))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await _serving(http, url, node)
            boom.set()  # the progress thread runs a step every few ms, idle or not
            status = 200
            while status == 200:
                try:
                    async with http.get(url + "/health") as r:
                        status = r.status
                except aiohttp.ClientConnectionError:
                    status = 0  # already stopped
                await asyncio.sleep(0.05)
        return status, await asyncio.wait_for(node, FATAL_STOP_TIMEOUT_S + 10)

    status, code = asyncio.run(asyncio.wait_for(body(), 120))
    assert status in (503, 0) and code == EXIT_NODE_FAILED
