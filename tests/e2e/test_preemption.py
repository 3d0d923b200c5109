"""A decode node that runs out of KV blocks preempts its newest stream, which then waits,
silent, until blocks free up: longer than the proxy's stall timeout when the others have
long to go. The engine keeps such a stream alive (a blank line every
`scheduler.KEEPALIVE_S` while it waits), so the proxy does not take the wait for a hung
node: no stall, no migration, and every completion is exactly the offline engine's.

Real processes on loopback: one prefill node, one decode node with a KV pool too small for
its streams' outputs, and a proxy with a 1 s stall timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from tests.support.aclient import Request, corpus_prompt, get_json, greedy_body, metric
from tests.support.aclient import offline_text as _expected
from tests.support.aclient import run_with_session as _run
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STALL_TIMEOUT_S = 1.0


async def _longest_silence(reqs: list[Request], within_s: float = 120.0) -> float:
    """Until every request is done (or `within_s`): the longest time, in seconds, that a
    started, unfinished stream went without a new event (sampled every 20 ms)."""
    loop = asyncio.get_running_loop()
    seen = [(0, loop.time()) for _ in reqs]
    longest, deadline = 0.0, loop.time() + within_s
    while not all(r.task.done() for r in reqs) and loop.time() < deadline:
        await asyncio.sleep(0.02)
        now = loop.time()
        for i, r in enumerate(reqs):
            events, since = seen[i]
            if r.result.events != events or r.task.done():
                seen[i] = (r.result.events, now)
            elif events:
                longest = max(longest, now - since)
    return longest


def test_a_preempted_stream_waiting_past_the_stall_timeout_is_not_called_stalled(
    tiny_model_dir: Path, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    # 3 streams of ~20 prompt + 120 output tokens need 3 x 9 blocks of 16 tokens; the pool
    # has 20, so the newest is preempted and waits for the first to finish: ~120 decode
    # steps of at least 30 ms, several seconds, against a stall timeout of 1 s.
    bodies = [greedy_body(corpus_prompt(tokenizer, 20, 300 * i), 120) for i in range(3)]
    with Cluster(tiny_model_dir) as cluster:
        prefill = cluster.node("prefill", "prefill-0", wait=False)
        decode = cluster.node(
            "decode", "decode-0", wait=False, num_blocks=20, debug_step_delay=0.03
        )
        cluster.wait_all()
        proxy = cluster.start_proxy([prefill], [decode], stall_timeout_s=STALL_TIMEOUT_S)

        async def scenario(session: aiohttp.ClientSession) -> None:
            reqs = [Request(session, proxy.url, b) for b in bodies]
            silent = await _longest_silence(reqs)
            results = await asyncio.gather(*(r.wait(120.0) for r in reqs))
            state = await get_json(session, f"{decode.url}/state")
            # The scenario happened: a stream that had started went quiet past the timeout.
            assert state["preemptions"] > 0 and silent > STALL_TIMEOUT_S, (state, silent)
            for b, res in zip(bodies, results, strict=True):
                assert res.error is None and res.done and res.finish_reason == "length", res
                assert res.text == _expected(tokenizer, offline_token_ids, b)
            for name in ("pdserve_proxy_stalls_total", "pdserve_proxy_migrations_total"):
                assert await metric(session, proxy.url, name) == 0, name
            assert state["integrity_violations"] == 0

        _run(scenario)
