"""Issue 5: a client that disconnects is cancelled wherever its request is (DESIGN.md §3).

One 1P1D cluster of real processes, slowed down on purpose so each stage lasts long enough
to be caught there: the prefill node sleeps 0.25 s after each engine step, takes one
sequence at a time, and posts each KV write 1.5 s late; the decode node runs one sequence at
a time. A second proxy in front of the same nodes admits one request at a time, so a second
one waits in its edge queue.

Each test puts a *target* request into one stage (seen through /state or /metrics), closes its
connection, and then shows within 2 s that nothing of it is left on any node, that another
request running at the same time still produces exactly the offline engine's output, and
that every node ends at its baseline.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.text.tokenizer import Tokenizer
from common.tiny.corpus import CORPUS
from common.wire.sampling_params import SamplingParams
from tests.support.aclient import Request, get_json, metric, until
from tests.support.cluster import Cluster, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


BLOCK_SIZE = 16
FREED_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def slow(tiny_model_dir: Path) -> Iterator[tuple[Cluster, Server]]:
    """The cluster, its main proxy, and (second) a proxy with one edge slot."""
    cluster = Cluster(tiny_model_dir)
    try:
        prefill = cluster.node(
            "prefill",
            "prefill",
            wait=False,
            max_num_seqs=1,
            debug_step_delay=0.25,
            debug_transfer_delay=1.5,
        )
        decode = cluster.node("decode", "decode", wait=False, max_num_seqs=1)
        cluster.wait_all()
        edge_proxy = cluster.start_proxy(
            prefill=[prefill], decode=[decode], max_active_requests=1, edge_queue_capacity=4
        )
        cluster.start_proxy(prefill=[prefill], decode=[decode])
        yield cluster, edge_proxy
    finally:
        cluster.close()


def _prompt(tokenizer: Tokenizer, n_tokens: int, at: int = 0) -> str:
    """A corpus slice of about n_tokens tokens (text, so the streamed text decodes exactly)."""
    ids = tokenizer.encode(CORPUS[at:])[:n_tokens]
    text = tokenizer.decode(ids)
    return text.encode("utf-8", "ignore").decode("utf-8").rstrip("\ufffd")


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


class Scenario:
    def __init__(
        self,
        cluster: Cluster,
        session: aiohttp.ClientSession,
        tokenizer: Tokenizer,
        offline_token_ids: Any,
    ):
        self.cluster = cluster
        self.session = session
        self.tokenizer = tokenizer
        self.offline_token_ids = offline_token_ids
        assert cluster.proxy is not None
        self.url = cluster.proxy.url
        self.prefill, self.decode = cluster.nodes()

    def start(self, body: dict[str, Any], url: str | None = None) -> Request:
        return Request(self.session, url or self.url, body)

    async def state(self, node: Server) -> dict[str, Any]:
        return await get_json(self.session, f"{node.url}/state")

    async def until_state(self, node: Server, what: str, check: Callable[[dict], bool]) -> None:
        async def ok() -> bool:
            return check(await self.state(node))

        await until(ok, 60.0, f"{node.name}: {what}")

    async def only_others_left(self, others: list[dict[str, Any]]) -> float:
        """Seconds until every node holds nothing but what `others` may use: at most one
        request entry (queued, running, held or reserved) for each, and their blocks."""
        budget = sum(
            math.ceil((len(self.tokenizer.encode(o["prompt"])) + o["max_tokens"]) / BLOCK_SIZE)
            for o in others
        )

        async def clean() -> bool:
            for node in (self.prefill, self.decode):
                st = await self.state(node)
                r, b = st["requests"], st["blocks"]
                entries = r["waiting"] + r["running"] + r["held"] + r["reserved"]
                if entries > len(others) or b["total"] - b["free"] > budget:
                    return False
            return True

        return await until(clean, FREED_WITHIN_S, "the cancelled request's blocks freed")

    async def check_output(self, req: Request, body: dict[str, Any]) -> None:
        res = await req.wait()
        assert res.error is None and res.done, res
        sp = SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], ignore_eos=True)
        want = self.offline_token_ids(self.tokenizer.encode(body["prompt"]), sp)
        assert res.text == self.tokenizer.decode(want)


def _run(
    slow: tuple[Cluster, Server],
    tokenizer: Tokenizer,
    offline_token_ids: Any,
    body: Callable[[Scenario], Any],
) -> None:
    cluster, _ = slow

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            sc = Scenario(cluster, session, tokenizer, offline_token_ids)
            await body(sc)

    asyncio.run(main())
    cluster.wait_baseline(timeout=30.0)


def test_cancel_in_edge_queue(slow, tokenizer: Tokenizer, offline_token_ids: Callable) -> None:
    _, edge_proxy = slow

    async def body(sc: Scenario) -> None:
        other_body = _body(_prompt(tokenizer, 40), 48)
        other = sc.start(other_body, edge_proxy.url)
        await sc.until_state(
            sc.decode, "the other request decoding", lambda s: s["requests"]["running"] == 1
        )
        target = sc.start(_body(_prompt(tokenizer, 30, 500), 16), edge_proxy.url)

        async def queued() -> bool:
            return await metric(sc.session, edge_proxy.url, "pdserve_edge_queue_depth") == 1

        await until(queued, 10.0, "the target waiting in the edge queue")
        await target.drop()

        async def left() -> bool:
            return await metric(sc.session, edge_proxy.url, "pdserve_edge_queue_depth") == 0

        await until(left, FREED_WITHIN_S, "the edge queue empty")
        assert (
            await metric(
                sc.session, edge_proxy.url, "pdserve_edge_exits_total", outcome="cancelled"
            )
            >= 1
        )
        await sc.only_others_left([other_body])
        await sc.check_output(other, other_body)

    _run(slow, tokenizer, offline_token_ids, body)


def test_cancel_in_prefill_queue(slow, tokenizer: Tokenizer, offline_token_ids: Callable) -> None:
    async def body(sc: Scenario) -> None:
        other_body = _body(_prompt(tokenizer, 1200), 8)  # 3 prefill chunks: >= 0.75 s
        other = sc.start(other_body)
        await sc.until_state(
            sc.prefill, "the other request prefilling", lambda s: s["requests"]["running"] == 1
        )
        target = sc.start(_body(_prompt(tokenizer, 30, 800), 16))
        await sc.until_state(
            sc.prefill, "the target in the prefill queue", lambda s: s["requests"]["waiting"] == 1
        )
        await target.drop()
        await sc.only_others_left([other_body])
        await sc.check_output(other, other_body)

    _run(slow, tokenizer, offline_token_ids, body)


def test_cancel_during_prefill_compute(
    slow, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    async def body(sc: Scenario) -> None:
        target = sc.start(_body(_prompt(tokenizer, 1500, 300), 16))  # 3 chunks
        await sc.until_state(
            sc.prefill, "the target prefilling", lambda s: s["requests"]["running"] == 1
        )
        other_body = _body(_prompt(tokenizer, 20, 1000), 12)
        other = sc.start(other_body)  # waits behind the target on the prefill node
        await sc.until_state(
            sc.prefill, "the other request queued", lambda s: s["requests"]["waiting"] == 1
        )
        await target.drop()
        await sc.only_others_left([other_body])
        await sc.check_output(other, other_body)

    _run(slow, tokenizer, offline_token_ids, body)


def test_cancel_while_held_in_interstage_queue(
    slow, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    async def body(sc: Scenario) -> None:
        other_body = _body(_prompt(tokenizer, 20, 200), 160)  # holds the one decode slot
        other = sc.start(other_body)
        await sc.until_state(
            sc.decode, "the other request decoding", lambda s: s["requests"]["running"] == 1
        )
        target = sc.start(_body(_prompt(tokenizer, 100, 600), 16))
        await sc.until_state(
            sc.prefill, "the target's KV held", lambda s: s["requests"]["held"] == 1
        )

        async def queued() -> bool:
            return await metric(sc.session, sc.url, "pdserve_interstage_queue_depth") == 1

        await until(queued, 10.0, "the target in the inter-stage queue")
        assert target.result.events == 1  # the first token reached the client: TTFT
        await target.drop()
        await sc.only_others_left([other_body])
        await sc.check_output(other, other_body)

    _run(slow, tokenizer, offline_token_ids, body)


def test_cancel_while_kv_transfer_in_flight(
    slow, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    async def body(sc: Scenario) -> None:
        target = sc.start(_body(_prompt(tokenizer, 300, 100), 16))
        await sc.until_state(
            sc.prefill, "the target sending", lambda s: s["requests"]["transferring"] == 1
        )
        await sc.until_state(
            sc.decode, "the target receiving", lambda s: s["requests"]["reserved"] == 1
        )
        await target.drop()
        await sc.only_others_left([])
        # The destination blocks go back to the pool: a late write into them would
        # corrupt the next request, which must come out exactly as offline.
        other_body = _body(_prompt(tokenizer, 300, 2000), 24)
        await sc.check_output(sc.start(other_body), other_body)

    _run(slow, tokenizer, offline_token_ids, body)


def test_cancel_while_decoding(slow, tokenizer: Tokenizer, offline_token_ids: Callable) -> None:
    async def body(sc: Scenario) -> None:
        target = sc.start(_body(_prompt(tokenizer, 50, 1500), 1000))

        async def streaming() -> bool:
            return target.result.events >= 5

        await until(streaming, 60.0, "the target streaming decode tokens")
        other_body = _body(_prompt(tokenizer, 40, 3000), 20)
        other = sc.start(other_body)  # waits for the one decode slot
        await sc.until_state(
            sc.prefill, "the other request held", lambda s: s["requests"]["held"] == 1
        )
        await target.drop()
        await sc.only_others_left([other_body])
        await sc.check_output(other, other_body)

    _run(slow, tokenizer, offline_token_ids, body)
