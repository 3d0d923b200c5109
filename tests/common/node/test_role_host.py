"""A node's role change, in-process: the host drains the prefill role (its held KV is freed
by the drain timeout), checks the block books, and serves as decode at the next epoch;
work for the old role or epoch is refused with 409, and illegal changes are refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.cli.node import create_node
from common.engine.config import EngineConfig
from common.node.host import NodeHost
from common.node.role_change import ROLE_MOVES, RoleState
from common.node.server import NodeConfig
from common.wire.errors import ApiError
from common.wire.fsm import IllegalTransition
from common.wire.node_messages import PrefillRequest, RoleChange, to_json
from common.wire.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig

TIMEOUT = aiohttp.ClientTimeout(total=30)


def _prefill(rid: str, epoch: int | None = None) -> bytes:
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return to_json(
        PrefillRequest(
            request_id=rid, prompt_token_ids=list(range(1, 40)), sampling=sampling, lease_s=60,
            epoch=epoch,
        )
    )  # fmt: skip


async def _post(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, Any]:
    async with http.post(url, data=body) as r:
        return r.status, json.loads(await r.read())


async def _with_node(role: str, model: Path, scenario: Any) -> None:
    engine = EngineConfig(model=str(model), num_blocks=64, threads=1)
    config = NodeConfig(role=role, engine=engine, transfer=TransferConfig(backend="zmq"))  # type: ignore[arg-type]
    node = await create_node(config)
    try:
        await node.start()
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            await scenario(node, http)
    finally:
        await node.stop()
    node.engine.check_integrity()


def test_a_prefill_node_becomes_a_decode_node_and_frees_what_it_held(tiny_model_dir: Path) -> None:
    async def scenario(node: NodeHost, http: aiohttp.ClientSession) -> None:
        status, result = await _post(http, f"{node.url}/internal/prefill", _prefill("r1", 0))
        assert status == 200 and result["kv"] is not None  # held, under a 60 s lease
        assert node.state()["requests"]["held"] == 1
        # No drain time: the held KV is released (the proxy would prefill it again).
        done = await node.change_role(RoleChange(role="decode", epoch=0, drain_timeout_s=0))
        assert (done.previous_role, done.role, done.epoch, done.evicted) == (
            "prefill", "decode", 1, 1,
        )  # fmt: skip
        st = node.state()
        assert (st["role"], st["epoch"], st["role_state"]) == ("decode", 1, "serving")
        blocks = st["blocks"]
        assert blocks["free"] == blocks["total"] and not any(st["requests"].values())
        # Work for the old role, or stamped with the old epoch, is not taken.
        status, err = await _post(http, f"{node.url}/internal/prefill", _prefill("r2"))
        assert (status, err["error"]["code"]) == (409, "wrong_role")
        async with http.get(f"{node.url}/health") as r:
            health = await r.json()
        assert (r.status, health["role"], health["epoch"]) == (200, "decode", 1)
        # Back to prefill: epoch 2; a prefill stamped with epoch 1 is stale there.
        await node.change_role(RoleChange(role="prefill"))
        status, err = await _post(http, f"{node.url}/internal/prefill", _prefill("r3", 1))
        assert (status, err["error"]["code"]) == (409, "stale_epoch")
        status, result = await _post(http, f"{node.url}/internal/prefill", _prefill("r4", 2))
        assert status == 200, result
        await node.role.cancel("r4")  # frees the held KV
        with pytest.raises(ApiError) as refused:
            await node.change_role(RoleChange(role="prefill"))
        assert refused.value.code == "same_role"
        with pytest.raises(ApiError) as refused:
            await node.change_role(RoleChange(role="decode", epoch=0))
        assert refused.value.code == "stale_epoch"

    asyncio.run(asyncio.wait_for(_with_node("prefill", tiny_model_dir, scenario), 120))


def test_a_colocated_node_keeps_its_role(tiny_model_dir: Path) -> None:
    async def scenario(node: NodeHost, http: aiohttp.ClientSession) -> None:
        change = to_json(RoleChange(role="decode"))
        status, err = await _post(http, f"{node.url}/internal/role", change)
        assert (status, err["error"]["code"]) == (409, "fixed_role")
        assert node.state()["switchable"] is False

    asyncio.run(asyncio.wait_for(_with_node("both", tiny_model_dir, scenario), 120))


def test_role_states_move_only_as_the_table_says() -> None:
    assert ROLE_MOVES.allows(RoleState.SERVING, RoleState.DRAINING)
    assert ROLE_MOVES.allows(RoleState.DRAINING, RoleState.SERVING)  # a failed drain
    assert ROLE_MOVES.terminal(RoleState.STOPPING)
    for old, new in (
        (RoleState.SERVING, RoleState.SWITCHING),  # never without a drain
        (RoleState.SWITCHING, RoleState.DRAINING),
        (RoleState.STOPPING, RoleState.SERVING),
    ):
        with pytest.raises(IllegalTransition):
            ROLE_MOVES.move("n", old, new)
