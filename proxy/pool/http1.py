"""A lean HTTP/1.1 client for the proxy's streamed node calls: the calls on every request's
first-token path (a streamed prefill's POST, a decode stream's POST) and the streams they
answer with.

aiohttp's client costs about 0.2 ms more per call than a bare asyncio connection from send
to headers (its request and response objects, its connector's bookkeeping, a task that
writes the body on Python 3.11), a fifth of what the proxy adds to a first token. This one
does only what those calls need:

- POST with a `Content-Length` body, over keep-alive connections pooled per node (LIFO, an
  idle connection is dropped after `idle_s` so that it never meets the server's own
  keep-alive timeout);
- the answer's status line and headers, then its body (chunked, `Content-Length` or
  read-to-close) through `readany` / `readline` / `read`; a body read to its end gives
  its connection back to the pool;
- `Response.close()` before the end drops the connection at once: the node takes the
  disconnect as a cancel.

Errors are `HttpError`s: `ConnectFailed` / `ConnectTimedOut` (nothing was sent),
`ConnectionBroken` (the connection ended before the answer did: the node may have taken
the request), `BadResponse` (not HTTP/1.1 as a node speaks it). Timeouts other than the
connect timeout are the caller's (`asyncio.timeout` around the calls).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024  # status line and headers
MAX_LINE_BYTES = 64 << 20  # readline's default limit
MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions
_HIGH_WATER = 4 << 20  # unread bytes at which a connection stops reading from its socket
_LOW_WATER = 1 << 20
_HEAD = (
    b"POST %s HTTP/1.1\r\nHost: %s\r\n%s"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
)


class HttpError(Exception):
    """A node call failed below HTTP's status codes."""


class ConnectFailed(HttpError):
    """No connection (refused, unreachable): the request was never sent."""


class ConnectTimedOut(HttpError):
    """No connection within the connect timeout: the request was never sent."""


class ConnectionBroken(HttpError):
    """The connection closed or reset before the answer ended."""


class BadResponse(HttpError):
    """The answer is not HTTP/1.1 as this client reads it."""


class Headers(dict[str, str]):
    """An answer's headers, names lower-cased; looked up in any case."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())


@dataclass(frozen=True)
class _Origin:
    host: str
    port: int
    tls: bool
    host_header: bytes


class _Connection(asyncio.Protocol):
    """One connection's socket events: received bytes are buffered, a reader waits for more."""

    def __init__(self, origin: _Origin, live: set[_Connection]) -> None:
        self.origin = origin
        self._live = live  # the client's open connections: this one leaves it when it ends
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False  # the peer closed, or the connection was lost or closed
        self.closed = False  # closed by us
        self.idle_since = 0.0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > _HIGH_WATER and not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._live.discard(self)
        if exc is not None and self._error is None:
            self._error = exc
        self._wake()

    # -- for readers -------------------------------------------------------------------------

    async def wait(self) -> None:
        """Until more bytes came, or the connection ended (ConnectionBroken)."""
        if self.eof:
            raise self.broken()
        if self._paused and len(self.buf) < _LOW_WATER and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def take(self, n: int) -> bytes:
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def broken(self) -> ConnectionBroken:
        if self.closed:
            return ConnectionBroken("connection closed")
        if self._error is not None:
            return ConnectionBroken(f"connection lost: {self._error}")
        return ConnectionBroken("server disconnected")

    def close(self) -> None:
        """Drop the connection now (a waiting reader gets ConnectionBroken)."""
        if not self.closed:
            self.closed = self.eof = True
            self._live.discard(self)
            if self.transport is not None:
                self.transport.abort()  # no flush: what was unsent is moot
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Response:
    """One answer: `status`, `headers`, the body (`content` is the response itself, as a
    reader: `readany`, `readline`, `read`); `close()` drops the connection unless the body
    was read to its end."""

    def __init__(
        self,
        client: Http1Client,
        conn: _Connection,
        status: int,
        headers: Headers,
        keep_alive: bool,
        length: int | None,
        chunked: bool,
    ) -> None:
        self.status = status
        self.headers = headers
        self._client = client
        self._conn: _Connection | None = conn
        self._keep_alive = keep_alive
        self._left = length  # Content-Length: bytes still to come; None: chunked or to close
        self._chunked = chunked
        self._chunk_left = 0  # of the current chunk
        self._chunk_crlf = False  # the current chunk's data ended, its CRLF not yet read
        self._done = length == 0  # the body's end was read
        self._pending = bytearray()  # decoded body bytes not yet returned (readline)
        if self._done:
            self._finish()

    @property
    def content(self) -> Response:
        return self

    async def readany(self) -> bytes:
        """The body bytes received so far and not yet read (at least one); b"" at its end."""
        if self._pending:
            data = bytes(self._pending)
            self._pending.clear()
            return data
        while True:
            data = self._decode()
            if data or self._done:
                return data
            await self._wait()

    async def readline(self, limit: int = MAX_LINE_BYTES) -> bytes:
        """The next line, with its b"\\n"; at the body's end what is left (b"" if nothing).
        BadResponse for a line over `limit` bytes."""
        pending = self._pending
        while True:
            i = pending.find(b"\n")
            if i >= 0:
                line = bytes(pending[: i + 1])
                del pending[: i + 1]
                return line
            if len(pending) > limit:
                raise BadResponse(f"a line over {limit} bytes")
            data = self._decode()
            if data:
                pending += data
                continue
            if self._done:
                line = bytes(pending)
                pending.clear()
                return line
            await self._wait()

    async def read(self, n: int = -1) -> bytes:
        """The body to its end, or its first `n` bytes when it is longer (n >= 0)."""
        out = bytearray(self._pending)
        self._pending.clear()
        while not self._done and (n < 0 or len(out) < n):
            data = self._decode()
            if data:
                out += data
            elif not self._done:
                await self._wait()
        if 0 <= n < len(out):
            self._pending += out[n:]
            del out[n:]
        return bytes(out)

    def close(self) -> None:
        """Drop the connection, unless the body was read to its end (it went back to the
        pool then). Idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -- internals ---------------------------------------------------------------------------

    async def _wait(self) -> None:
        conn = self._conn
        if conn is None:
            raise ConnectionBroken("connection closed")
        if conn.eof and self._left is None and not self._chunked:
            self._done = True  # read to close: the close is the end
            self._finish()
            return
        await conn.wait()

    def _decode(self) -> bytes:
        """The body bytes the connection's buffer holds, decoded; sets `_done` at the end."""
        conn = self._conn
        if conn is None or self._done:
            return b""
        buf = conn.buf
        if not buf:
            return b""
        if not self._chunked:
            if self._left is None:
                return conn.take(len(buf))
            data = conn.take(min(self._left, len(buf)))
            self._left -= len(data)
            if self._left == 0:
                self._done = True
                self._finish()
            return data
        parts: list[bytes] = []
        while buf:
            if self._chunk_left:
                data = conn.take(min(self._chunk_left, len(buf)))
                self._chunk_left -= len(data)
                self._chunk_crlf = self._chunk_left == 0
                parts.append(data)
                continue
            if self._chunk_crlf:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise BadResponse("a chunk does not end with CRLF")
                del buf[:2]
                self._chunk_crlf = False
                continue
            i = buf.find(b"\r\n")
            if i < 0:
                if len(buf) > MAX_CHUNK_LINE:
                    raise BadResponse("a chunk-size line is too long")
                break
            try:
                size = int(bytes(buf[:i]).split(b";", 1)[0], 16)
            except ValueError:
                raise BadResponse(f"a bad chunk size: {bytes(buf[:i])[:40]!r}") from None
            if size < 0:
                raise BadResponse("a negative chunk size")
            if size == 0:  # the last chunk: then CRLF, or trailers up to CRLF CRLF
                end = buf.find(b"\r\n\r\n", i)
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise BadResponse("the answer's trailers are too long")
                    break  # their end has not come yet
                del buf[: end + 4]
                self._done = True
                self._finish()
                break
            del buf[: i + 2]
            self._chunk_left = size
        return b"".join(parts)

    def _finish(self) -> None:
        """The body ended: the connection goes back to the pool (or is closed)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._keep_alive and not conn.buf and not conn.eof:
            self._client._release(conn)
        else:
            conn.close()


class Http1Client:
    """POSTs to nodes over pooled keep-alive connections. `close()` drops every connection."""

    def __init__(
        self,
        connect_timeout_s: float,
        headers: Mapping[str, str] | None = None,
        idle_s: float = 30.0,
        max_idle_per_node: int = 256,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.max_idle_per_node = max_idle_per_node
        self._extra = b"".join(
            b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in (headers or {}).items()
        )
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._closed = False
        self._tls: ssl.SSLContext | None = None
        self.opened = 0  # connections made, over the client's life (each call reuses one if it can)

    async def post(self, base_url: str, path: str, body: bytes) -> Response:
        """POST `body` (JSON) to `base_url + path`: the answer, once its headers came."""
        if self._closed:
            raise ConnectFailed("the client is closed")
        origin = self._origin(base_url)
        conn = self._checkout(origin) or await self._connect(origin)
        head = _HEAD % (path.encode("latin-1"), origin.host_header, self._extra, len(body))
        try:
            assert conn.transport is not None
            conn.transport.write(head + body)
            return await self._answer(conn)
        except BaseException:
            conn.close()
            raise

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()

    # -- internals ---------------------------------------------------------------------------

    def _origin(self, base_url: str) -> _Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectFailed(f"not an http(s) URL: {base_url!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            host = parts.hostname
            shown = f"[{host}]" if ":" in host else host
            origin = _Origin(host, port, tls, f"{shown}:{port}".encode("idna"))
            self._origins[base_url] = origin
        return origin

    def _checkout(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_ok = asyncio.get_running_loop().time() - self.idle_s
        while idle:
            conn = idle.pop()
            if not conn.eof and not conn.buf and conn.idle_since >= oldest_ok:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if self._closed or len(idle) >= self.max_idle_per_node:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(origin, self._all), origin.host, origin.port, ssl=tls
                )
        except TimeoutError:
            raise ConnectTimedOut(
                f"no connection to {origin.host}:{origin.port} within {self.connect_timeout_s:g} s"
            ) from None
        except OSError as e:
            raise ConnectFailed(
                f"cannot connect to {origin.host}:{origin.port}: {e.strerror or e}"
            ) from None
        self._all.add(conn)
        self.opened += 1
        return conn

    async def _answer(self, conn: _Connection) -> Response:
        while True:  # 1xx answers are skipped
            buf = conn.buf
            while (end := buf.find(b"\r\n\r\n")) < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise BadResponse("the answer's headers are too long")
                await conn.wait()
            head = conn.take(end + 4)[:-4].decode("latin-1")
            status_line, *lines = head.split("\r\n")
            version, _, rest = status_line.partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise BadResponse(f"not an HTTP/1.1 answer: {status_line[:60]!r}")
            status = int(code)
            if status >= 200:
                break
        headers = Headers()
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise BadResponse(f"a bad header line: {line[:60]!r}")
            headers[name.strip().lower()] = value.strip()
        keep_alive = (
            version == "HTTP/1.1" and "close" not in (headers.get("connection") or "").lower()
        )
        chunked = "chunked" in (headers.get("transfer-encoding") or "").lower()
        length: int | None = None
        if status in (204, 304):
            length = 0
        elif not chunked:
            raw = headers.get("content-length")
            if raw is None:
                keep_alive = False  # read to close
            else:
                try:
                    length = int(raw)
                except ValueError:
                    raise BadResponse(f"a bad Content-Length: {raw[:40]!r}") from None
                if length < 0:
                    raise BadResponse("a negative Content-Length")
        return Response(self, conn, status, headers, keep_alive, length, chunked)
