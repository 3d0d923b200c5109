"""Issue 5: node failures, leases, KV-wait timeouts, overload and graceful shutdown, with real
processes on loopback.

The module's cluster has two prefill and two decode nodes. Prefill nodes sleep 0.2 s after
each engine step and decode nodes 0.03 s, so a long prompt is still computing, and a long
generation still streaming, when the test kills a node. Two proxies front the same nodes:
one with the default migration limit (1) and one that never migrates. A test that kills a
node restarts it on the same URL and checks that the proxy takes it back.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from tests.support.aclient import Request, get_json, metric, stream_completion, until
from tests.support.aclient import corpus_prompt as _prompt
from tests.support.aclient import greedy_body as _body
from tests.support.aclient import holds as _true
from tests.support.aclient import offline_text as _expected
from tests.support.aclient import run_with_session as _run
from tests.support.cluster import Cluster, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Pools:
    def __init__(self, cluster: Cluster, migrating: Server, plain: Server) -> None:
        self.cluster = cluster
        self.migrating = migrating  # proxy with --migrate-limit 1 (the default)
        self.plain = plain  # proxy with --migrate-limit 0
        self.prefill = [p for p in cluster.nodes() if p.name.startswith("prefill")]
        self.decode = [p for p in cluster.nodes() if p.name.startswith("decode")]

    def replace(self, old: Server, new: Server) -> None:
        for pool in (self.prefill, self.decode):
            if old in pool:
                pool[pool.index(old)] = new


@pytest.fixture(scope="module")
def pools(slow_2p2d: Cluster) -> Iterator[Pools]:
    """The shared slow 2P2D nodes (tests/e2e/conftest.py) behind two proxies."""
    nodes = slow_2p2d.nodes()
    prefill = [n for n in nodes if n.name.startswith("prefill")]
    decode = [n for n in nodes if n.name.startswith("decode")]
    plain = slow_2p2d.start_proxy(prefill, decode, migrate_limit=0, poll_interval_s=0.2)
    migrating = slow_2p2d.start_proxy(prefill, decode, poll_interval_s=0.2)
    try:
        yield Pools(slow_2p2d, migrating, plain)
    finally:
        for proxy in (plain, migrating):
            proxy.stop()


async def _busy(session: aiohttp.ClientSession, nodes: list[Server], key: str) -> Server:
    """The node of `nodes` whose /state shows a request under `key` (running, held...)."""
    found: list[Server] = []

    async def one() -> bool:
        for node in nodes:
            st = await get_json(session, f"{node.url}/state")
            if st["requests"][key] >= 1:
                found.append(node)
                return True
        return False

    await until(one, 30.0, f"a node with a {key} request")
    return found[0]


async def _node_status(session: aiohttp.ClientSession, proxy: Server, url: str) -> str:
    listed = await get_json(session, f"{proxy.url}/admin/nodes")
    return next(n["status"] for n in listed["nodes"] if n["url"] == url)


async def _rejoin(pools: Pools, session: aiohttp.ClientSession, dead: Server) -> Server:
    """Restart `dead` on its URL; every proxy marks it up again without any manual step."""
    for proxy in (pools.migrating, pools.plain):
        await until(
            lambda proxy=proxy: _node_status_is(session, proxy, dead.url, "down"),
            5.0,
            f"{proxy.name} marking {dead.name} down",
        )
    # On this thread: a child gets its parent-death signal when the *thread* that
    # started it ends, so never start nodes from a worker thread.
    new = pools.cluster.restart(dead)
    pools.replace(dead, new)
    for proxy in (pools.migrating, pools.plain):

        async def up(proxy: Server = proxy) -> bool:
            return await _node_status(session, proxy, new.url) == "up"

        await until(up, 10.0, f"{proxy.name} taking {new.name} back")
    return new


def test_decode_killed_mid_stream_migrates_to_the_other_decode_node(
    pools: Pools, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    body = _body(_prompt(tokenizer, 60, 100), 160)

    async def scenario(session: aiohttp.ClientSession) -> None:
        req = Request(session, pools.migrating.url, body)
        await until(lambda: _true(req.result.events >= 10), 60.0, "ten streamed tokens")
        victim = await _busy(session, pools.decode, "running")
        victim.kill()
        res = await req.wait(60.0)
        # One uninterrupted stream, token for token what the offline engine produces.
        assert res.error is None and res.done and res.finish_reason == "length", res
        assert res.text == _expected(tokenizer, offline_token_ids, body)
        migrations = await metric(
            session, pools.migrating.url, "pdserve_proxy_migrations_total", outcome="started"
        )
        assert migrations == 1
        await asyncio.to_thread(pools.cluster.wait_baseline, 10.0)  # the prefill side too
        new = await _rejoin(pools, session, victim)
        # Routed to again: concurrent requests spread over both decode nodes.
        bodies = [_body(_prompt(tokenizer, 20, 400 + 50 * i), 8) for i in range(4)]
        results = await asyncio.gather(
            *(stream_completion(session, pools.migrating.url, b) for b in bodies)
        )
        for b, r in zip(bodies, results, strict=True):
            assert r.text == _expected(tokenizer, offline_token_ids, b)
        served = await metric(session, new.url, "pdserve_node_requests_total", outcome="admitted")
        assert served >= 1

    _run(scenario)
    pools.cluster.wait_baseline(10.0)


def test_decode_killed_without_migration_ends_stream_with_error_event(
    pools: Pools, tokenizer: Tokenizer
) -> None:
    body = _body(_prompt(tokenizer, 40, 900), 300)

    async def scenario(session: aiohttp.ClientSession) -> None:
        req = Request(session, pools.plain.url, body)
        await until(lambda: _true(req.result.events >= 5), 60.0, "five streamed tokens")
        victim = await _busy(session, pools.decode, "running")
        victim.kill()
        killed = time.monotonic()
        res = await req.wait(30.0)
        assert time.monotonic() - killed < 10.0  # a prompt final event, not a hang
        assert res.error is not None and res.done
        assert res.error["type"] == "server_error" and res.error["message"]
        await asyncio.to_thread(pools.cluster.wait_baseline, 10.0)
        await _rejoin(pools, session, victim)

    _run(scenario)


def test_prefill_killed_before_first_token_retries_on_the_other(
    pools: Pools, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    body = _body(_prompt(tokenizer, 1500, 50), 12)  # 3 prefill chunks: >= 0.6 s computing

    async def scenario(session: aiohttp.ClientSession) -> None:
        req = Request(session, pools.plain.url, body)
        victim = await _busy(session, pools.prefill, "running")
        assert req.result.events == 0
        victim.kill()
        res = await req.wait(60.0)
        assert res.status == 200 and res.error is None and res.done, res
        assert res.text == _expected(tokenizer, offline_token_ids, body)
        retries = await metric(session, pools.plain.url, "pdserve_proxy_prefill_retries_total")
        assert retries >= 1
        await asyncio.to_thread(pools.cluster.wait_baseline, 10.0)
        await _rejoin(pools, session, victim)

    _run(scenario)


def test_lease_expiry_frees_held_blocks_and_fails_a_later_transfer(
    pools: Pools, tokenizer: Tokenizer
) -> None:
    prefill, decode = pools.prefill[0], pools.decode[0]
    prompt = tokenizer.encode(_prompt(tokenizer, 100, 1200))
    sampling = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}

    async def scenario(session: aiohttp.ClientSession) -> None:
        expiries = await metric(session, prefill.url, "pdserve_lease_expiries_total")
        msg = {
            "type": "prefill_request",
            "request_id": "lease-test",
            "prompt_token_ids": prompt,
            "sampling": sampling,
            "lease_s": 0.5,
        }
        async with session.post(f"{prefill.url}/internal/prefill", json=msg) as resp:
            assert resp.status == 200
            result = await resp.json()
        assert result["kv"]["num_blocks"] >= 1
        st = await get_json(session, f"{prefill.url}/state")
        assert st["requests"]["held"] == 1

        async def expired() -> bool:
            st = await get_json(session, f"{prefill.url}/state")
            return st["requests"]["held"] == 0 and st["blocks"]["free"] == st["blocks"]["total"]

        await until(expired, 5.0, "the expired lease freeing the held blocks")
        assert await metric(session, prefill.url, "pdserve_lease_expiries_total") == expiries + 1
        decode_msg = {
            "type": "decode_request",
            "request_id": "lease-test",
            "prompt_token_ids": prompt,
            "first_token_id": result["first_token_id"],
            "sampling": sampling,
            "kv": result["kv"],
        }
        async with session.post(f"{decode.url}/internal/decode", json=decode_msg) as resp:
            lines = (await resp.text()).splitlines()
        assert resp.status == 200 and len(lines) == 1, lines
        assert '"error_code":"kv_failed"' in lines[0].replace(" ", "")

    _run(scenario)
    pools.cluster.wait_baseline(10.0)


def test_overload_answers_503_with_retry_after_then_recovers(
    pools: Pools, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    proxy = pools.cluster.start_proxy(
        pools.prefill, pools.decode, max_active_requests=1, edge_queue_capacity=1
    )
    running_body = _body(_prompt(tokenizer, 30, 2500), 60)
    waiting_body = _body(_prompt(tokenizer, 30, 2600), 8)

    async def scenario(session: aiohttp.ClientSession) -> None:
        running = Request(session, proxy.url, running_body)
        await until(lambda: _true(running.result.events >= 1), 30.0, "the first request running")
        waiting = Request(session, proxy.url, waiting_body)

        async def queued() -> bool:
            return await metric(session, proxy.url, "pdserve_edge_queue_depth") == 1

        await until(queued, 10.0, "the second request in the edge queue")
        started = time.monotonic()
        refused = await stream_completion(session, proxy.url, waiting_body)
        assert time.monotonic() - started < 5.0  # at once, not after the queue drains
        assert refused.status == 503 and float(refused.headers["Retry-After"]) >= 1
        assert refused.error is not None and refused.error["code"] == "overloaded"
        assert set(refused.error) >= {"message", "type", "param", "code"}
        for req, body in ((running, running_body), (waiting, waiting_body)):
            res = await req.wait(60.0)
            assert res.error is None and res.text == _expected(tokenizer, offline_token_ids, body)
        again = await stream_completion(session, proxy.url, waiting_body)  # no restart needed
        assert again.status == 200 and again.text == _expected(
            tokenizer, offline_token_ids, waiting_body
        )

    try:
        _run(scenario)
    finally:
        proxy.stop()
    pools.cluster.wait_baseline(10.0)


def test_sigterm_drains_frees_every_block_and_exits_0(
    pools: Pools, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    """A decode node told to stop mid-stream stops admitting, gives its in-flight stream
    the drain timeout (1 s), then cancels it, frees every block and exits 0; the proxy
    moves the stream to the other decode node."""
    body = _body(_prompt(tokenizer, 50, 3000), 200)

    async def scenario(session: aiohttp.ClientSession) -> None:
        req = Request(session, pools.migrating.url, body)
        await until(lambda: _true(req.result.events >= 5), 60.0, "five streamed tokens")
        victim = await _busy(session, pools.decode, "running")
        victim.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(victim.wait, 30)
        assert code == 0
        log = victim.log_path.read_text()
        assert "stopped: blocks" in log
        last = log[log.rindex("stopped: blocks") :].splitlines()[0]
        assert '"free": 256' in last and '"total": 256' in last, last
        res = await req.wait(60.0)
        assert res.error is None and res.text == _expected(tokenizer, offline_token_ids, body)

        async def marked_down() -> bool:
            return await _node_status(session, pools.migrating, victim.url) == "down"

        await until(marked_down, 5.0, "the stopped node marked down")
        await until(lambda: _node_status_is(session, pools.plain, victim.url, "down"), 5.0, "down")
        await _rejoin(pools, session, victim)

    _run(scenario)
    pools.cluster.wait_baseline(10.0)


@pytest.fixture(scope="module")
def slow_transfers(tiny_model_dir: Path) -> Iterator[tuple[Cluster, dict[str, list[Server]]]]:
    """Two 1P1D pairs whose prefill node delays every transfer by 3 s, started at once: one
    whose decode node waits 1 s for KV, one whose prefill node aborts a write after 1 s."""
    with Cluster(tiny_model_dir) as cluster:
        pairs = {
            "kv_wait": [
                cluster.node("prefill", "prefill-a", wait=False, debug_transfer_delay=3.0),
                cluster.node("decode", "decode-a", wait=False, kv_wait_timeout=1.0),
            ],
            "sending": [
                cluster.node(
                    "prefill", "prefill-b", wait=False, debug_transfer_delay=3.0,
                    sending_timeout=1.0,
                ),
                cluster.node("decode", "decode-b", wait=False, kv_wait_timeout=60.0),
            ],
        }  # fmt: skip
        cluster.wait_all()
        for name, (prefill, decode) in pairs.items():
            pairs[name].append(cluster.start_proxy([prefill], [decode], migrate_limit=0))
        yield cluster, pairs


def test_kv_that_never_arrives_times_out_and_frees_the_reservation(
    slow_transfers: tuple[Cluster, dict[str, list[Server]]],
) -> None:
    cluster, pairs = slow_transfers
    _, decode, proxy = pairs["kv_wait"]

    async def scenario(session: aiohttp.ClientSession) -> None:
        res = await stream_completion(session, proxy.url, _body("Once upon a time", 8))
        assert res.status == 200 and res.events == 1  # the first token, from prefill
        assert res.error is not None and "kv_timeout" in res.error["message"]
        assert await metric(session, decode.url, "pdserve_kv_wait_timeouts_total") == 1

    _run(scenario)
    cluster.wait_baseline(10.0)


def test_a_write_past_the_sending_deadline_is_aborted_and_freed(
    slow_transfers: tuple[Cluster, dict[str, list[Server]]],
) -> None:
    """Issue 13: SENDING had no deadline. A write still not done (here: not even posted)
    past --sending-timeout is aborted; its blocks go once it is quiescent, and the decode
    node hears KVAborted instead of waiting out its own timeout."""
    cluster, pairs = slow_transfers
    prefill, decode, proxy = pairs["sending"]

    async def scenario(session: aiohttp.ClientSession) -> None:
        res = await stream_completion(session, proxy.url, _body("Once upon a time", 8))
        assert res.status == 200 and res.events == 1  # the first token, from prefill
        assert res.error is not None and "kv_failed" in res.error["message"], res.error
        assert await metric(session, prefill.url, "pdserve_sending_timeouts_total") == 1
        assert await metric(session, decode.url, "pdserve_kv_wait_timeouts_total") == 0

    _run(scenario)
    cluster.wait_baseline(10.0)


async def _node_status_is(
    session: aiohttp.ClientSession, proxy: Server, url: str, status: str
) -> bool:
    return await _node_status(session, proxy, url) == status
