"""Issue 16: hung is not dead. Real node processes on loopback, stopped with SIGSTOP (a GC
pause, swapping, a partition without a reset: nothing breaks, nothing answers) and resumed
with SIGCONT.

- A decode node stopped mid-stream: its streams continue on the other decode node (stall or
  node-down, then one re-prefill), token for token what the offline engine produces, while
  the node is still stopped; requests sent while it is silent never go to it; after SIGCONT
  it frees every block exactly once (its streams' Cancels and disconnects reach it) and
  rejoins.
- A prefill node stopped with requests in its queue and prefilled requests held in the
  inter-stage queue: those are prefilled again on the other node and complete, exactly.

Every node is back at baseline at the end. The proxy runs with a short stall timeout and
silence window so that the scenarios take seconds, not the defaults' tens of seconds.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from tests.support.aclient import Request, corpus_prompt, get_json, greedy_body, metric, until
from tests.support.aclient import holds as _true
from tests.support.aclient import offline_text as _expected
from tests.support.aclient import run_with_session as _run
from tests.support.cluster import Cluster, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LIVENESS = {"stall_timeout_s": 2.0, "silent_after_s": 1.0, "poll_interval_s": 0.2}


async def _admin_row(session: aiohttp.ClientSession, proxy: Server, url: str) -> dict[str, Any]:
    listed = await get_json(session, f"{proxy.url}/admin/nodes")
    return next(n for n in listed["nodes"] if n["url"] == url)


async def _running_on(session: aiohttp.ClientSession, node: Server) -> int:
    return int((await get_json(session, f"{node.url}/state"))["requests"]["running"])


class Stopped:
    """SIGSTOP `node` now; SIGCONT when the block ends, whatever happens in it."""

    def __init__(self, node: Server) -> None:
        self.node = node

    def __enter__(self) -> Server:
        self.node.send_signal(signal.SIGSTOP)
        return self.node

    def __exit__(self, *exc: object) -> None:
        self.node.send_signal(signal.SIGCONT)


@dataclass
class Pools:
    cluster: Cluster
    proxy: Server
    prefill: list[Server]
    decode: list[Server]


@pytest.fixture(scope="module")
def pools(slow_2p2d: Cluster) -> Iterator[Pools]:
    """The shared slow 2P2D nodes behind one proxy with short liveness limits."""
    nodes = slow_2p2d.nodes()
    prefill = [n for n in nodes if n.name.startswith("prefill")]
    decode = [n for n in nodes if n.name.startswith("decode")]
    proxy = slow_2p2d.start_proxy(prefill, decode, **LIVENESS)
    try:
        yield Pools(slow_2p2d, proxy, prefill, decode)
    finally:
        proxy.stop()


def test_a_stopped_decode_node_s_streams_continue_elsewhere_and_new_work_avoids_it(
    pools: Pools, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    cluster, proxy, decode = pools.cluster, pools.proxy, pools.decode
    bodies = [greedy_body(corpus_prompt(tokenizer, 30, 200 + 40 * i), 80) for i in range(4)]
    later = [greedy_body(corpus_prompt(tokenizer, 20, 900 + 40 * i), 16) for i in range(2)]

    async def scenario(session: aiohttp.ClientSession) -> None:
        reqs = [Request(session, proxy.url, b) for b in bodies]
        await until(
            lambda: _true(all(r.result.events >= 5 for r in reqs)), 60.0, "every stream under way"
        )
        counts = [await _running_on(session, d) for d in decode]
        victim = decode[0] if counts[0] >= counts[1] else decode[1]
        other = decode[1] if victim is decode[0] else decode[0]
        with Stopped(victim):
            # Silent before down: new requests go to the node that answers, and finish
            # while the victim is still stopped.
            async def silent() -> bool:
                return bool((await _admin_row(session, proxy, victim.url))["silent"])

            await until(silent, 10.0, "the proxy calling the stopped node silent")
            fresh = [Request(session, proxy.url, b) for b in later]
            for b, r in zip(later, fresh, strict=True):
                res = await r.wait(60.0)
                assert res.error is None and res.text == _expected(tokenizer, offline_token_ids, b)
            # The stopped node's streams moved (stall or node-down) and finish, exactly,
            # while it is still stopped; their traces name the cause.
            causes = []
            for b, r in zip(bodies, reqs, strict=True):
                res = await r.wait(90.0)
                assert res.error is None and res.done and res.finish_reason == "length", res
                assert res.text == _expected(tokenizer, offline_token_ids, b)
                rid = res.headers["X-Request-Id"]
                trace = await get_json(session, f"{proxy.url}/debug/requests/{rid}/trace")
                causes += [
                    row["detail"].split()[0] for row in trace["rows"] if row["event"] == "migrating"
                ]
            assert causes and set(causes) <= {"stalled", "node_down"}, causes
            assert victim.alive() and (await _admin_row(session, proxy, victim.url))["status"]
            moved = sum(
                [
                    await metric(
                        session, proxy.url, "pdserve_proxy_migrations_total",
                        outcome="started", cause=cause,
                    )
                    for cause in ("stalled", "node_down")
                ]
            )  # fmt: skip
            assert moved >= 1
            served = await metric(
                session, other.url, "pdserve_node_requests_total", outcome="admitted"
            )
            assert served >= len(later) + moved
        # SIGCONT: the stopped node gets its Cancels and disconnects, frees exactly once,
        # and the proxy takes it back.
        await asyncio.to_thread(cluster.wait_baseline, 30.0)

        async def back() -> bool:
            row = await _admin_row(session, proxy, victim.url)
            return row["status"] == "up" and not row["silent"]

        await until(back, 15.0, "the resumed node rejoining")
        state = await get_json(session, f"{victim.url}/state")
        assert state["integrity_violations"] == 0

    _run(scenario)


def test_a_stopped_prefill_node_s_queued_and_held_requests_are_prefilled_again_elsewhere(
    pools: Pools, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    cluster, proxy, prefill = pools.cluster, pools.proxy, pools.prefill
    # Spread over both prefill nodes by their queues; the decode slots keep the rest queued.
    bodies = [greedy_body(corpus_prompt(tokenizer, 200 + 40 * i, 100 * i), 24) for i in range(6)]

    async def scenario(session: aiohttp.ClientSession) -> None:
        reqs = [Request(session, proxy.url, b) for b in bodies]

        async def queued() -> bool:
            text = await _text(session, f"{proxy.url}/metrics")
            return "pdserve_interstage_queue_depth 0.0" not in text

        await until(queued, 60.0, "prefilled requests waiting for decode slots")
        # The prefill node holding the most: prefilled (held for the queue) or still queued.
        load = []
        for node in prefill:
            requests = (await get_json(session, f"{node.url}/state"))["requests"]
            load.append(requests["held"] + requests["waiting"] + requests["running"])
        victim = prefill[load.index(max(load))]
        with Stopped(victim):
            for b, r in zip(bodies, reqs, strict=True):
                res = await r.wait(120.0)
                assert res.error is None and res.done, res
                assert res.text == _expected(tokenizer, offline_token_ids, b)
            lost = await metric(
                session, proxy.url, "pdserve_proxy_migrations_total", cause="node_down"
            )
            retried = await metric(session, proxy.url, "pdserve_proxy_prefill_retries_total")
            assert lost + retried >= 1
        await asyncio.to_thread(cluster.wait_baseline, 60.0)

    _run(scenario)


async def _text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.text()
