"""Issue 5: a client that disconnects is cancelled wherever its request is (DESIGN.md §3).

One 1P1D cluster of real processes, slowed down on purpose so each stage lasts long enough
to be caught there: both nodes sleep 0.25 s after each engine step and run one sequence at a
time, and the prefill node posts each KV write 1.5 s late. A second proxy in front of the
same nodes admits one request at a time, so a second one waits in its edge queue.

Each test puts a *target* request into one stage (seen through /state or /metrics), closes its
connection, and then shows within 2 s that nothing of it is left on any node, that another
request running at the same time still produces exactly the offline engine's output, and
that every node ends at its baseline. It also asserts, from the proxy's trace of the target,
the stage the proxy saw and each node's answer to the proxy's Cancel: the stage the node found
the request in ("queued", "running", "held", "transfer"), or "not held".

Why the answers are deterministic: a dropped connection also makes the node's handler abort
the request, and the engine applies that abort only at the start of its next step, which the
0.25 s step delay keeps well after the proxy's Cancel (sent right after the disconnect) has
read the stage; a write posted 1.5 s late keeps the prefill node's block set SENDING
("transfer") for that long.
"""

from __future__ import annotations

import asyncio
import json
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
STEP_DELAY_S = 0.25
NOT_HELD = "not held"  # a node's answer when the request was not (or no longer) there


# Every request through the prefill pool, the inter-stage queue and a KV transfer: these tests
# follow a request through those stages (conditional disaggregation, `--disagg-mode auto`, may
# prefill one on the decode node instead; tests/e2e/test_service.py covers that).
ALWAYS = {"disagg_mode": "always"}


@pytest.fixture(scope="module")
def slow_cluster(tiny_model_dir: Path) -> Iterator[tuple[Cluster, Server]]:
    """The cluster, its main proxy, and (second) a proxy with one edge slot."""
    cluster = Cluster(tiny_model_dir)
    try:
        prefill = cluster.node(
            "prefill",
            "prefill",
            wait=False,
            max_num_seqs=1,
            debug_step_delay=STEP_DELAY_S,
            debug_transfer_delay=1.5,
        )
        decode = cluster.node(
            "decode", "decode", wait=False, max_num_seqs=1, debug_step_delay=STEP_DELAY_S
        )
        cluster.wait_all()
        # The stages as they are without KV streaming (one write after the first token);
        # tests/e2e/test_kv_streaming.py cancels streamed KV at its own stages.
        edge_proxy = cluster.start_proxy(
            prefill=[prefill], decode=[decode], max_active_requests=1, edge_queue_capacity=4,
            kv_streaming="off", **ALWAYS,
        )  # fmt: skip
        # Room before decode for more than the decode node's one sequence, so that requests
        # queue on the prefill node (by default the edge would hold them back).
        cluster.start_proxy(
            prefill=[prefill], decode=[decode], interstage_capacity=4, kv_streaming="off",
            **ALWAYS,
        )  # fmt: skip
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
        self.main_proxy = cluster.proxy
        self.url = cluster.proxy.url
        self.prefill, self.decode = cluster.nodes()
        # Where each proxy's log stood when the test began: its trace lines from here on.
        self._log_start = {p.url: p.log_path.stat().st_size for p in cluster.proxies}

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

    def _logged_traces(self, proxy: Server) -> list[dict[str, Any]]:
        """The traces `proxy` logged (one JSON line per request, when its response closed)
        since the test began."""
        with open(proxy.log_path, "rb") as log:
            log.seek(self._log_start[proxy.url])
            lines = log.read().decode(errors="replace").split("\n")[:-1]  # complete lines
        marker = '{"trace"'
        return [json.loads(line[line.index(marker) :])["trace"] for line in lines if marker in line]

    async def cancel_answers(
        self, proxy: Server, stage: str, expected: int
    ) -> list[tuple[str, str]]:
        """The target's trace on `proxy`, found as the one request it logged cancelled since
        the test began (a request dropped before its first token never received its
        X-Request-Id). Asserts that the proxy saw it cancelled by the disconnect during
        `stage`; returns each node's answer to the proxy's Cancel, (node, the stage the node
        found it in or NOT_HELD), sorted, once `expected` of them are in the trace."""
        cancelled: list[str] = []

        async def logged() -> bool:
            traces = self._logged_traces(proxy)
            cancelled[:] = [t["request_id"] for t in traces if t["outcome"] == "cancelled"]
            return bool(cancelled)

        await until(logged, 5.0, f"{proxy.name} logging the cancelled request's trace")
        assert len(cancelled) == 1, cancelled
        (rid,) = cancelled
        names = {self.prefill.url: "prefill", self.decode.url: "decode"}
        trace: dict[str, Any] = {}
        answers: list[tuple[str, str]] = []

        async def answered() -> bool:
            nonlocal trace, answers
            trace = await get_json(self.session, f"{proxy.url}/debug/requests/{rid}/trace")
            answers = sorted(
                (
                    names[r["owner"]],
                    r["detail"] if r["event"] == "cancel acknowledged" else NOT_HELD,
                )
                for r in trace["rows"]
                if r["event"].startswith("cancel") and r["owner"] != "proxy"
            )
            return len(answers) >= expected

        await until(answered, 5.0, f"{expected} node answer(s) to the Cancel of {rid}")
        assert trace["outcome"] == "cancelled"
        ended = [(r["owner"], r["detail"]) for r in trace["rows"] if r["event"] == "cancelled"]
        assert ended == [("proxy", f"disconnect during {stage}")], trace
        return answers


def _run(
    slow_cluster: tuple[Cluster, Server],
    tokenizer: Tokenizer,
    offline_token_ids: Any,
    body: Callable[[Scenario], Any],
) -> None:
    cluster, _ = slow_cluster

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            sc = Scenario(cluster, session, tokenizer, offline_token_ids)
            await body(sc)

    asyncio.run(main())
    cluster.wait_baseline(timeout=30.0)


def test_cancel_in_edge_queue(
    slow_cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    _, edge_proxy = slow_cluster

    async def body(sc: Scenario) -> None:
        other_body = _body(_prompt(tokenizer, 40), 24)  # 6 s of 0.25 s decode steps
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
        # It never left the proxy: no node was asked to cancel it.
        assert await sc.cancel_answers(edge_proxy, "edge", expected=0) == []

    _run(slow_cluster, tokenizer, offline_token_ids, body)


def test_cancel_in_prefill_queue(
    slow_cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
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
        assert await sc.cancel_answers(sc.main_proxy, "prefill", expected=1) == [
            ("prefill", "queued")
        ]

    _run(slow_cluster, tokenizer, offline_token_ids, body)


def test_cancel_during_prefill_compute(
    slow_cluster, tokenizer: Tokenizer, offline_token_ids: Callable
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
        assert await sc.cancel_answers(sc.main_proxy, "prefill", expected=1) == [
            ("prefill", "running")
        ]

    _run(slow_cluster, tokenizer, offline_token_ids, body)


def test_cancel_while_held_in_interstage_queue(
    slow_cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
    async def body(sc: Scenario) -> None:
        other_body = _body(_prompt(tokenizer, 20, 200), 24)  # holds the one decode slot
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
        # Only the prefill node held it; the full decode node never took it.
        assert await sc.cancel_answers(sc.main_proxy, "interstage", expected=1) == [
            ("prefill", "held")
        ]

    _run(slow_cluster, tokenizer, offline_token_ids, body)


def test_cancel_while_kv_transfer_in_flight(
    slow_cluster, tokenizer: Tokenizer, offline_token_ids: Callable
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
        answers = dict(await sc.cancel_answers(sc.main_proxy, "transfer", expected=2))
        # The write is posted 1.5 s late: the prefill node still had the KV transfer in
        # flight (its block set SENDING) when the Cancel came; "not held" here would mean
        # the transfer had already ended.
        assert answers["prefill"] == "transfer"
        # The decode node's answer is the one the step delay cannot fix: the dropped stream
        # makes its handler abort the receive at once, and that abort's round trip to the
        # prefill node (a KVAborted back, the reservation freed when quiescent) races the
        # proxy's Cancel, which then finds the receive in flight or already gone. Either
        # way it was never running there.
        assert answers["decode"] in ("transfer", NOT_HELD), answers

    _run(slow_cluster, tokenizer, offline_token_ids, body)


def test_cancel_while_decoding(
    slow_cluster, tokenizer: Tokenizer, offline_token_ids: Callable
) -> None:
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
        # A decode token had come: only the decode node had it, running.
        assert await sc.cancel_answers(sc.main_proxy, "decode", expected=1) == [
            ("decode", "running")
        ]

    _run(slow_cluster, tokenizer, offline_token_ids, body)
