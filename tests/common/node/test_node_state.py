"""A real node's `GET /state` carries every field the proxy's `NodeState` reads: the proxy's
tests run against stand-in nodes that send them all, so a field only the stand-ins sent
(as `step_time_max_s` was until session 28, which left every stall timeout at the flat
--stall-timeout-s) would pass every other test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from common.cli.node import create_node
from common.engine.config import EngineConfig
from common.node.server import NodeConfig
from kv_transfer.config import TransferConfig
from proxy.pool.node_state import NodeState

# Fields a node of that role has no value for, by design.
NOT_FOR = {"both": {"kv_transfer"}, "prefill": set(), "decode": set()}


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_a_real_node_s_state_has_every_field_the_proxy_reads(
    role: str, tiny_model_dir: Path
) -> None:
    async def body() -> None:
        engine = EngineConfig(model=str(tiny_model_dir), num_blocks=64, threads=1)
        transfer = TransferConfig(backend="zmq")
        node = await create_node(NodeConfig(role=role, engine=engine, transfer=transfer))  # type: ignore[arg-type]
        try:
            await node.start()  # after the warm-up: its steps were timed
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                async with http.get(f"{node.url}/state") as r:
                    assert r.status == 200
                    raw = await r.json()
        finally:
            await node.stop()
        missing = set(NodeState.model_fields) - set(raw) - NOT_FOR[role]
        assert not missing, f"a {role} node's /state lacks {sorted(missing)}"
        state = NodeState.parse(raw)
        assert state.step_time_max_s is not None and state.step_time_max_s > 0

    asyncio.run(body())
