"""Issue 15, item 5: a node changes role at run time (POST /admin/nodes/role) under streaming
load, losing no request and leaking no block; `pdserve up --auto-roles` moves a node when
the load shifts to long prompts."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from common.wire.node_messages import PrefillRequest, to_json
from common.wire.sampling_params import SamplingParams
from tests.support.aclient import Request, get_json, metric, until
from tests.support.aclient import corpus_prompt as _prompt
from tests.support.aclient import greedy_body as _body
from tests.support.aclient import offline_text as _expected
from tests.support.aclient import run_with_session as _run
from tests.support.cluster import Cluster, Server, Service
from tests.support.http import http_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@dataclass
class Pools:
    cluster: Cluster
    proxy: Server
    prefill: Server
    decode: list[Server]


@pytest.fixture(scope="module")
def pools(slow_2p2d: Cluster) -> Iterator[Pools]:
    """1P2D of the shared slow nodes (tests/e2e/conftest.py: decode steps take 0.03 s, so
    streams are still running when a node moves) behind this module's proxy."""
    prefill = next(n for n in slow_2p2d.nodes() if n.name == "prefill-0")
    decode = [n for n in slow_2p2d.nodes() if n.name.startswith("decode")]
    # Every prompt to the prefill pool: the moved node must get prefill work once it is a
    # prefill node (with `auto`, short prompts could be prefilled on decode-0 instead).
    proxy = slow_2p2d.start_proxy([prefill], decode, poll_interval_s=0.2, disagg_mode="always")
    try:
        yield Pools(slow_2p2d, proxy, prefill, decode)
    finally:
        try:
            # A test that failed mid-move must not leave the shared nodes to the next module
            # with a decode node in the prefill pool.
            for node in decode:
                if node.state()["role"] != "decode":
                    body = {"url": node.url, "role": "decode"}
                    http_json(f"{proxy.url}/admin/nodes/role", body, timeout=60.0)
        finally:
            proxy.stop()


async def _move(session: aiohttp.ClientSession, proxy: Server, body: dict[str, Any]) -> Any:
    async with session.post(f"{proxy.url}/admin/nodes/role", json=body) as resp:
        answer = await resp.json(content_type=None)
        assert resp.status == 200, answer
        return answer


async def _row(session: aiohttp.ClientSession, proxy: Server, url: str) -> dict[str, Any]:
    listed = await get_json(session, f"{proxy.url}/admin/nodes")
    return next(n for n in listed["nodes"] if n["url"] == url)


def _bodies(tokenizer: Tokenizer, n: int, at: int) -> list[dict[str, Any]]:
    return [_body(_prompt(tokenizer, 30 + 7 * i, at + 60 * i), 32) for i in range(n)]


def test_a_node_moves_both_ways_under_load_losing_nothing(
    pools: Pools, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    proxy, decode1 = pools.proxy, pools.decode[1]
    bodies = _bodies(tokenizer, 12, 0)

    async def scenario(session: aiohttp.ClientSession) -> None:
        # decode-1 -> prefill with no drain time: its running streams are moved on at once
        # (the proxy continues them on decode-0), new requests keep coming meanwhile.
        reqs = [Request(session, proxy.url, b) for b in bodies[:6]]

        async def decoding() -> bool:
            return (await get_json(session, f"{decode1.url}/state"))["requests"]["running"] > 0

        await until(decoding, 60.0, "decode-1 running a stream")
        moving = asyncio.ensure_future(
            _move(session, proxy, {"url": decode1.url, "role": "prefill", "drain_timeout_s": 0})
        )
        reqs += [Request(session, proxy.url, b) for b in bodies[6:8]]
        moved = await moving
        assert (moved["previous_role"], moved["role"], moved["epoch"]) == ("decode", "prefill", 1)
        assert moved["evicted"] >= 1
        row = await _row(session, proxy, decode1.url)
        assert (row["role"], row["status"], row["epoch"]) == ("prefill", "up", 1)
        # ... and back to decode once it prefills, with time to drain: what it computes and
        # holds is sent to decode-0, not dropped.
        reqs += [Request(session, proxy.url, b) for b in bodies[8:]]

        async def prefilling() -> bool:
            reqs = (await get_json(session, f"{decode1.url}/state"))["requests"]
            return any(reqs[k] for k in ("waiting", "running", "held", "transferring"))

        await until(prefilling, 30.0, "decode-1 prefilling as a prefill node")
        back = await _move(session, proxy, {"url": decode1.url, "role": "decode"})
        assert (back["role"], back["epoch"]) == ("decode", 2)
        for body, req in zip(bodies, reqs, strict=True):
            res = await req.wait(120.0)
            assert res.error is None and res.finish_reason == "length", res
            assert res.text == _expected(tokenizer, offline_token_ids, body)
        migrated = await metric(
            session, proxy.url, "pdserve_proxy_migrations_total", cause="role_change"
        )
        assert migrated >= 1
        moves = await metric(session, proxy.url, "pdserve_proxy_role_moves_total", outcome="moved")
        assert moves == 2
        changes = await metric(session, decode1.url, "pdserve_node_role_changes_total")
        assert changes == 2

    _run(scenario)
    pools.cluster.wait_baseline(10.0)
    state = decode1.state()
    assert (state["role"], state["epoch"], state["role_state"]) == ("decode", 2, "serving")


def test_work_for_another_role_or_epoch_is_refused_with_409(pools: Pools) -> None:
    decode1, prefill = pools.decode[1], pools.prefill
    epoch = decode1.state()["epoch"]
    sampling = SamplingParams(temperature=0.0, max_tokens=2)
    stale = PrefillRequest(
        request_id="stale", prompt_token_ids=[1, 2, 3], sampling=sampling, lease_s=5, epoch=epoch
    )
    for url, body, code in (
        (f"{decode1.url}/internal/prefill", json.loads(to_json(stale)), "wrong_role"),
        (f"{prefill.url}/internal/prefill", json.loads(to_json(stale)), "stale_epoch"),
    ):
        if code == "stale_epoch":
            body["epoch"] = 7  # the prefill node is at epoch 0
        with pytest.raises(urllib.error.HTTPError) as err:
            http_json(url, body)
        assert err.value.code == 409
        assert json.loads(err.value.read())["error"]["code"] == code
    # The last node of a pool stays; a decode node cannot move to `both`.
    for body, code in (
        ({"url": prefill.url, "role": "decode"}, "last_node"),
        ({"url": decode1.url, "role": "both"}, "fixed_role"),
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            http_json(f"{pools.proxy.url}/admin/nodes/role", body)
        assert err.value.code == 409
        assert json.loads(err.value.read())["error"]["code"] == code
    pools.cluster.wait_baseline(10.0)


def test_auto_roles_moves_a_decode_node_when_prompts_get_long(
    tiny_model_dir: Path, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    args = ["--prefill", "1", "--decode", "2", "--auto-roles", "--auto-roles-window-s", "1"]
    args += ["--auto-roles-sample-s", "0.2", "--auto-roles-margin-s", "0.05"]
    args += ["--prefill-node-args=--debug-step-delay 0.2 --max-num-batched-tokens 512"]
    bodies = [_body(_prompt(tokenizer, 300 + 5 * i, 40 * i), 4) for i in range(16)]
    with Service(tiny_model_dir, *args) as svc:

        async def scenario(session: aiohttp.ClientSession) -> None:
            async def roles() -> dict[str, int]:
                listed = await get_json(session, f"{svc.url}/admin/nodes")
                counts = {"prefill": 0, "decode": 0}
                for n in listed["nodes"]:
                    counts[n["role"]] += 1
                return counts

            assert await roles() == {"prefill": 1, "decode": 2}
            reqs = [Request(session, svc.url, b) for b in bodies]  # a burst of long prompts

            async def moved() -> bool:
                return await roles() == {"prefill": 2, "decode": 1}

            await until(moved, 90.0, "the planner moving a decode node to prefill")
            for body, req in zip(bodies, reqs, strict=True):
                res = await req.wait(180.0)
                assert res.error is None and res.finish_reason == "length", res
                assert res.text == _expected(tokenizer, offline_token_ids, body)
            planned = await metric(
                session, svc.url, "pdserve_proxy_role_moves_total", trigger="planner"
            )
            assert planned == 1

        async def with_auth() -> None:
            async with aiohttp.ClientSession(headers=svc.auth) as session:
                await scenario(session)

        asyncio.run(with_auth())
        svc.wait_baseline(10.0)
        deadline = time.monotonic() + 10
        while "reason: prefill queue wait" not in svc.log_path.read_text():
            assert time.monotonic() < deadline, "the move's reason is not in the log"
            time.sleep(0.1)
