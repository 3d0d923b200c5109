"""NodeClient's reading of transport failures: a connect timeout (a partition, a silent
node) means the request never reached the node, so the caller may send it to another one;
any other timeout does not. And its reading of token streams: lines however the bytes are
split, merged when several wait, errors after the tokens before them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from common.wire.node_messages import (
    GenerateRequest,
    PrefillRequest,
    RoleChange,
    TokenDelta,
    to_json,
)
from common.wire.sampling_params import SamplingParams
from proxy.http.backend import BackendError, NodeLost, TokenChunk
from proxy.pool import http1
from proxy.pool.client import GENERATE_PATH, NodeClient, NodeTimeouts, NodeUnreachable
from proxy.pool.node_stream import MAX_LINE_BYTES

SP = SamplingParams(temperature=0.0, max_tokens=4)


def _client(error: type[BaseException]) -> NodeClient:
    """A client whose transport (`http1`, for prefills and streams alike) fails with `error`:
    `ConnectTimedOut` is its connect timeout, a TimeoutError the caller's own read timeout."""
    client = NodeClient(NodeTimeouts(connect_s=0.5))

    class Transport:
        async def post(self, *args: Any, **kwargs: Any) -> Any:
            raise error("timed out")

    client._http = Transport()  # type: ignore[assignment]
    return client


@pytest.mark.parametrize("op", ["prefill", "stream"])
def test_a_connect_timeout_is_unreachable_and_a_read_timeout_is_not(op: str) -> None:
    async def call(client: NodeClient) -> None:
        if op == "prefill":
            msg = PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=SP, lease_s=5)
            await client.prefill("http://n", msg)
        else:
            msg = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SP)
            await client.open_stream("http://n", GENERATE_PATH, msg, "r")

    with pytest.raises(NodeUnreachable, match="no connection within 0.5 s") as err:
        asyncio.run(call(_client(http1.ConnectTimedOut)))
    assert not err.value.maybe_received  # nothing was sent: no Cancel needed
    with pytest.raises(BackendError) as err2:
        asyncio.run(call(_client(TimeoutError)))
    assert not isinstance(err2.value, NodeUnreachable)  # it may be computing: not retried


# -- reading token streams ---------------------------------------------------------------------


def _line(request_id: str = "r", **fields: Any) -> bytes:
    return to_json(TokenDelta(request_id=request_id, **fields)) + b"\n"


async def _serve(
    writes: list[bytes], gate: asyncio.Event, peers: list[object] | None = None
) -> tuple[web.AppRunner, str]:
    """A node whose /internal/generate writes `writes[0]`, waits for `gate`, then writes the
    rest, each as it is (lines split or joined as the test wants), then ends. `peers`: each
    request's client address, appended."""

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        if peers is not None and request.transport is not None:
            peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(writes[0])
        await gate.wait()
        for data in writes[1:]:
            await resp.write(data)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(GENERATE_PATH, generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _read_all(writes: list[bytes]) -> list[TokenChunk | BaseException]:
    """Every chunk (or the error that ended the stream) of a stream written as `writes`; the
    writes after the first come only once the first chunk was read."""
    gate = asyncio.Event()
    runner, url = await _serve(writes, gate)
    client = NodeClient(NodeTimeouts(read_line_s=5.0, stall_s=0))
    await client.start()
    out: list[TokenChunk | BaseException] = []
    try:
        msg = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SP)
        stream = await client.open_stream(url, GENERATE_PATH, msg, "r")
        try:
            while True:
                chunk = await stream.next_chunk()
                out.append(chunk)
                if not gate.is_set():
                    gate.set()
                    await asyncio.sleep(0.2)  # the rest arrives before the next read
                if chunk.finish_reason is not None:
                    return out
        except BackendError as e:
            out.append(e)
            return out
        finally:
            stream.close()
    finally:
        await client.close()
        await runner.cleanup()


def test_lines_received_while_the_reader_was_away_come_as_one_chunk() -> None:
    first = _line(token_ids=[1], num_cached_tokens=3)
    last = _line(token_ids=[5], finish_reason="stop")
    rest = _line(token_ids=[2]) + _line(token_ids=[3, 4]) + last
    chunks = asyncio.run(_read_all([first, rest]))
    assert chunks == [TokenChunk([1], None, 3), TokenChunk([2, 3, 4, 5], "stop")]
    assert chunks[1].num_cached_tokens is None  # (only the stream's first line has it)


def test_a_line_split_over_writes_and_blank_lines_read_as_the_same_tokens() -> None:
    line = _line(token_ids=[2])
    last = _line(token_ids=[3], finish_reason="length")
    writes = [_line(token_ids=[1]), b"\n" + line[:5], line[5:] + b"\n", last[:-1], last[-1:]]
    chunks = asyncio.run(_read_all(writes))
    assert [t for c in chunks if isinstance(c, TokenChunk) for t in c.token_ids] == [1, 2, 3]
    assert isinstance(chunks[-1], TokenChunk) and chunks[-1].finish_reason == "length"


def test_tokens_before_an_error_line_are_relayed_then_the_error_is_raised() -> None:
    rest = _line(token_ids=[2]) + _line(token_ids=[], error="engine died") + _line(token_ids=[9])
    chunks = asyncio.run(_read_all([_line(token_ids=[1]), rest]))
    assert chunks[:2] == [TokenChunk([1]), TokenChunk([2])]
    error = chunks[2]
    assert isinstance(error, BackendError) and "engine died" in error.message


def test_a_stream_ending_mid_line_or_an_endless_line_is_a_failure() -> None:
    cut = asyncio.run(_read_all([_line(token_ids=[1]), b'{"type":"token_delta"']))
    assert isinstance(cut[-1], NodeLost) and "without finishing" in cut[-1].message
    endless = asyncio.run(_read_all([_line(token_ids=[1]), b"x" * (MAX_LINE_BYTES + 10)]))
    assert isinstance(endless[-1], BackendError) and "over" in endless[-1].message


def test_a_stream_read_to_its_end_leaves_its_connection_to_the_next() -> None:
    """(The connection goes back to the pool when the body ends; closing the stream keeps that.)"""

    async def body() -> list[object]:
        gate, peers = asyncio.Event(), []
        gate.set()
        writes = [_line(token_ids=[1], finish_reason="length")]
        runner, url = await _serve(writes, gate, peers)
        client = NodeClient(NodeTimeouts(read_line_s=5.0, stall_s=0))
        await client.start()
        try:
            for rid in ("r", "r", "r"):
                msg = GenerateRequest(request_id=rid, prompt_token_ids=[1], sampling=SP)
                stream = await client.open_stream(url, GENERATE_PATH, msg, rid)
                assert (await stream.next_chunk()).finish_reason == "length"
                await asyncio.sleep(0.05)  # the end of the response body arrives
                stream.close()
        finally:
            await client.close()
            await runner.cleanup()
        return peers

    peers = asyncio.run(body())
    assert len(peers) == 3 and len(set(peers)) == 1  # one connection, three streams


@pytest.mark.parametrize(
    ("path", "status", "code", "expected"),
    [
        ("/internal/prefill", 409, "stale_epoch", (503, "unavailable")),  # did not take it
        ("/internal/prefill", 409, "wrong_role", (503, "unavailable")),
        ("/internal/role", 409, "role_change_in_progress", (409, "role_change_in_progress")),
        ("/internal/role", 503, "role_change_failed", (503, "role_change_failed")),
    ],
)
def test_role_change_answers_keep_their_meaning(
    path: str, status: int, code: str, expected: tuple[int, str]
) -> None:
    """A node that changed role did not take the work (another node may); a refused or
    failed role change keeps the node's status and code."""

    async def refuse(request: web.Request) -> web.Response:
        error = {"message": "no", "type": "invalid_request_error", "param": None, "code": code}
        return web.json_response({"error": error}, status=status)

    async def body() -> BackendError:
        app = web.Application()
        app.router.add_post(path, refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = NodeClient(NodeTimeouts())
        await client.start()
        try:
            with pytest.raises(BackendError) as err:
                if path == "/internal/role":
                    await client.change_role(url, RoleChange(role="decode"), 5.0)
                else:
                    req = PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=SP,
                                         lease_s=5, epoch=0)  # fmt: skip
                    await client.prefill(url, req)
            return err.value
        finally:
            await client.close()
            await runner.cleanup()

    error = asyncio.run(asyncio.wait_for(body(), 20))
    assert (error.status, error.code) == expected
    assert isinstance(error, NodeUnreachable) == (code in ("stale_epoch", "wrong_role"))
