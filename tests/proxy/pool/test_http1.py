"""The streamed calls' HTTP/1.1 client (`proxy.pool.http1`) against a server that writes
exactly the bytes a test gives it, split as the test splits them: bodies read the same
however they arrive, a connection is reused only when its answer was read to the end, and
each way a connection can fail is the error its caller maps."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from proxy.pool import http1

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """Answers each request on a connection with `script`; counts connections and requests,
    and records what each connection saw last (EOF or a request)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.eofs = 0  # connections the client ended
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                await self.script(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eofs += 1
        finally:
            writer.close()


def writes(*parts: bytes, pause_s: float = 0.02, close: bool = False) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        if close:
            writer.close()

    return script


CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n"


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def _lines(resp: http1.Response) -> list[bytes]:
    out = []
    while line := await resp.content.readline():
        out.append(line)
    return out


@pytest.mark.parametrize(
    "parts",
    [
        [CHUNKED + b"\r\n6\r\na\nbc\nd\r\n3\r\nef\n\r\n0\r\n\r\n"],  # all at once
        [CHUNKED, b"\r\n6\r", b"\na\nb", b"c\nd\r", b"\n3", b"\r\nef\n\r\n0\r", b"\n\r\n"],
        [CHUNKED + b"\r\n6;ext=1\r\na\nbc\nd\r\n3\r\nef\n\r\n0\r\nX-Trailer: 1\r\n", b"\r\n"],
    ],
    ids=["whole", "split everywhere", "extensions and trailers"],
)
def test_a_chunked_body_reads_as_the_same_lines_however_it_arrives(parts: list[bytes]) -> None:
    async def body() -> None:
        server = Server(writes(*parts))
        async with server as url:
            client = http1.Http1Client(1.0, {"Authorization": "Bearer t"})
            resp = await client.post(url, "/x", b'{"a":1}')
            assert resp.status == 200 and resp.headers["content-type"] == "application/x-ndjson"
            assert await _lines(resp) == [b"a\n", b"bc\n", b"def\n"]
            resp = await client.post(url, "/x", b"{}")  # read to its end: the same connection
            data = b""
            while more := await resp.content.readany():
                data += more
            assert data == b"a\nbc\ndef\n"
            assert server.connections == 1
            assert server.requests[0].startswith(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1:")
            assert b"Authorization: Bearer t\r\n" in server.requests[0]
            assert server.requests[0].endswith(b'Content-Length: 7\r\n\r\n{"a":1}')
            await client.close()

    run(body())


def test_content_length_and_read_to_close_bodies() -> None:
    async def body() -> None:
        sized = writes(b"HTTP/1.1 503 Unavailable\r\nContent-Length: 9\r\nRetry-After: 2\r\n\r\n", b"abcd", b"efghi")  # fmt: skip  # noqa: E501
        server = Server(sized)
        async with server as url:
            client = http1.Http1Client(1.0)
            resp = await client.post(url, "/x", b"{}")
            assert (resp.status, resp.headers.get("retry-after")) == (503, "2")
            assert await resp.content.read(6) == b"abcdef"  # the first 6 bytes
            assert await resp.content.read() == b"ghi"
            resp = await client.post(url, "/x", b"{}")
            assert await resp.content.read() == b"abcdefghi"
            assert server.connections == 1
            await client.close()
        to_close = writes(b"HTTP/1.1 200 OK\r\n\r\nline one\nline", b" two", close=True)
        server = Server(to_close)
        async with server as url:
            client = http1.Http1Client(1.0)
            for _ in range(2):
                resp = await client.post(url, "/x", b"{}")
                assert await _lines(resp) == [b"line one\n", b"line two"]
            assert server.connections == 2  # a body read to close leaves nothing to reuse
            await client.close()

    run(body())


def test_a_response_closed_before_its_end_drops_the_connection() -> None:
    async def body() -> None:
        endless = writes(CHUNKED + b"\r\n2\r\na\n\r\n", *[b"2\r\nb\n\r\n"] * 50, pause_s=0.05)
        server = Server(endless)
        async with server as url:
            client = http1.Http1Client(1.0)
            resp = await client.post(url, "/x", b"{}")
            assert await resp.content.readline() == b"a\n"
            resp.close()
            resp.close()  # idempotent
            for _ in range(100):
                if server.eofs:
                    break
                await asyncio.sleep(0.02)
            assert server.eofs == 1  # the node saw the disconnect (its cancel)
            with pytest.raises(http1.ConnectionBroken):
                await resp.content.readline()
            resp = await client.post(url, "/x", b"{}")  # a new connection
            assert await resp.content.readline() == b"a\n"
            assert server.connections == 2
            await client.close()

    run(body())


def test_closing_a_response_wakes_its_reader() -> None:
    async def body() -> None:
        async with Server(writes(CHUNKED + b"\r\n", pause_s=5.0)) as url:
            client = http1.Http1Client(1.0)
            resp = await client.post(url, "/x", b"{}")
            reader = asyncio.create_task(resp.content.readany())
            await asyncio.sleep(0.05)
            resp.close()
            with pytest.raises(http1.ConnectionBroken, match="closed"):
                await asyncio.wait_for(reader, 1.0)
            await client.close()

    run(body())


def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    async def body() -> None:
        once = writes(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", close=True)
        server = Server(once)
        async with server as url:
            client = http1.Http1Client(1.0)
            for _ in range(3):
                resp = await client.post(url, "/x", b"{}")
                assert await resp.content.read() == b"ok"
                await asyncio.sleep(0.05)  # the server's close arrives
            assert server.connections == 3
            await client.close()

    run(body())


@pytest.mark.parametrize(
    ("script", "error", "match"),
    [
        (writes(close=True), http1.ConnectionBroken, "disconnected"),
        (writes(b"HTTP/1.1 200 OK\r\nContent-Le", close=True), http1.ConnectionBroken, "discon"),
        (writes(b"SSH-2.0-OpenSSH\r\n\r\n"), http1.BadResponse, "not an HTTP/1.1 answer"),
        (writes(CHUNKED + b"\r\nzz\r\n"), http1.BadResponse, "chunk size"),
        (writes(CHUNKED + b"\r\n4\r\nab", close=True), http1.ConnectionBroken, "discon"),
    ],
    ids=["no answer", "cut headers", "not http", "bad chunk", "cut body"],
)
def test_each_failure_is_its_error(script: Script, error: type[Exception], match: str) -> None:
    async def body() -> None:
        async with Server(script) as url:
            client = http1.Http1Client(1.0)
            with pytest.raises(error, match=match):
                resp = await client.post(url, "/x", b"{}")
                await resp.content.read()
            await client.close()

    run(body())


def test_no_listener_is_connect_failed() -> None:
    async def body() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = http1.Http1Client(1.0)
        with pytest.raises(http1.ConnectFailed, match="cannot connect"):
            await client.post(f"http://127.0.0.1:{port}", "/x", b"{}")
        await client.close()

    run(body())


def test_a_line_over_the_limit_is_a_bad_response() -> None:
    async def body() -> None:
        async with Server(writes(CHUNKED + b"\r\n4\r\nabcd\r\n", b"4\r\nefgh\r\n")) as url:
            client = http1.Http1Client(1.0)
            resp = await client.post(url, "/x", b"{}")
            with pytest.raises(http1.BadResponse, match="a line over 6 bytes"):
                await resp.content.readline(limit=6)
            await client.close()

    run(body())
