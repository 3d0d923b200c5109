"""Stand-in nodes for load-testing the proxy alone (`scripts/bench_proxy.py`).

A `StandInNode` speaks the nodes' internal HTTP API (`common.wire.node_messages`): `/health`,
`/state`, `/internal/{prefill,prefill_streamed,extend,decode,generate,cancel}`, and answers
at once, with no engine and no KV behind it. A prefill returns token `tokens[0]` and a KV
handle nobody will read (streamed: the handle's line, then the result's at once); a decode
(or generate) streams `max_tokens - 1` (or `max_tokens`) token lines from `tokens`, one
line per write as a real node writes them, the last one finishing "length".
`token_interval_s` paces the lines (0: back to back). What a benchmark measures through
these nodes is the proxy's own cost, nothing about serving.

It is a small HTTP/1.1 server on asyncio's protocol API (keep-alive, Content-Length request
bodies, chunked responses), not aiohttp: a load test of the proxy must spend less CPU on
the other side than the proxy spends, or it measures itself.

`written[request_id]` keeps when (time.monotonic()) each streamed line was written, while
`record_writes` is set, so a client in the same process can tell how long the proxy took to
relay each token.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Sequence
from typing import Any

from common.wire.node_messages import (
    CancelResult,
    KVHandle,
    LeaseExtendResult,
    PrefillAccepted,
    PrefillResult,
    TokenDelta,
    to_json,
)

_MARK = 987654321  # a token id that cannot occur in a line's other fields
_RID = "standin-request-id-mark"
MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 2**20


def _split(template: bytes, *marks: str) -> list[bytes]:
    parts = [template]
    for mark in marks:
        head, tail = parts.pop().split(mark.encode(), 1)
        parts += [head, tail]
    return parts


class StandInNode:
    """One stand-in node of `role` ("prefill", "decode" or "both") on 127.0.0.1."""

    def __init__(
        self,
        role: str,
        tokens: Sequence[int],
        fingerprint: str = "bench-proxy-standin",
        token_interval_s: float = 0.0,
        max_num_seqs: int = 100_000,
    ) -> None:
        if not tokens:
            raise ValueError("a stand-in node needs at least one token id to stream")
        self.role = role
        self.tokens = [str(t).encode() for t in tokens]
        self.first_token = int(tokens[0])
        self.fingerprint = fingerprint
        self.token_interval_s = token_interval_s
        self.max_num_seqs = max_num_seqs
        self.engine_id = f"standin-{role}-{uuid.uuid4().hex[:6]}"
        self.record_writes = False
        self.written: dict[str, list[float]] = {}
        self.active = 0
        self.streams = 0  # streams started, over the node's life
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        line = to_json(TokenDelta(request_id=_RID, token_ids=[_MARK]))
        last = to_json(TokenDelta(request_id=_RID, token_ids=[_MARK], finish_reason="length"))
        self._line = _split(line + b"\n", _RID, str(_MARK))
        self._last = _split(last + b"\n", _RID, str(_MARK))

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        bound = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- answers -----------------------------------------------------------------------------

    def answer(self, conn: _Connection, method: str, path: str, body: bytes) -> None:
        if method == "GET" and path == "/health":
            conn.send_json(200, {"status": "ok", "role": self.role})
        elif method == "GET" and path == "/state":
            conn.send_json(200, self._state())
        elif method != "POST":
            conn.send_json(405, {"error": {"message": "method not allowed"}})
        elif path == "/internal/prefill":
            conn.send_body(200, to_json(self._prefill(json.loads(body))))
        elif path == "/internal/prefill_streamed":
            # The KV handle, then the result at once: the prompt "computed" instantly, and
            # the decode stand-in reads no KV.
            result = self._prefill(json.loads(body))
            conn.start_chunked(200, "application/x-ndjson", with_first_chunk=True)
            if result.kv is not None:
                accepted = PrefillAccepted(request_id=result.request_id, kv=result.kv)
                conn.send_chunk(to_json(accepted) + b"\n")
            conn.end_chunked(to_json(result) + b"\n")
        elif path in ("/internal/decode", "/internal/generate"):
            msg = json.loads(body)
            decode = path == "/internal/decode"
            count = int(msg["sampling"].get("max_tokens") or 16) - (1 if decode else 0)
            self._stream(conn, msg["request_id"], count, 1 if decode else 0)
        elif path == "/internal/extend":
            ids = json.loads(body)["request_ids"]
            conn.send_body(200, to_json(LeaseExtendResult(extended=ids, missing=[])))
        elif path == "/internal/cancel":
            rid = json.loads(body)["request_id"]
            conn.send_body(200, to_json(CancelResult(request_id=rid, found=False)))
        else:
            conn.send_json(404, {"error": {"message": f"no route {path}"}})

    def _state(self) -> dict[str, Any]:
        free = 1_000_000
        return {
            "role": self.role,
            "engine_id": self.engine_id,
            "model_fingerprint": self.fingerprint,
            "blocks": {"total": free, "free": free, "used": 0, "held": 0},
            "requests": {"waiting": 0, "running": self.active, "transferring": 0},
            "capacity": {
                "max_num_seqs": self.max_num_seqs,
                "running": self.active,
                "reserved": 0,
                "free_blocks": free,
                "block_size": 16,
            },
            "queued_prefill_tokens": 0,
            "prefill_tokens_per_s": 1e9,  # instant: the proxy's budgets never bind
        }

    def _prefill(self, msg: dict[str, Any]) -> PrefillResult:
        num_tokens = len(msg["prompt_token_ids"])
        one = (msg["sampling"].get("max_tokens") or 16) <= 1
        kv = KVHandle(
            engine_id=self.engine_id,
            side_channel="tcp://127.0.0.1:1",  # never dialled: the decode stand-in reads no KV
            num_blocks=1 + num_tokens // 16,
            num_tokens=num_tokens,
            lease_deadline=time.time() + float(msg["lease_s"]),
            transfer_key=secrets.token_hex(16),
        )
        result = PrefillResult(
            request_id=msg["request_id"],
            first_token_id=self.first_token,
            finish_reason="length" if one else None,
            kv=None if one else kv,
        )
        return result

    def _stream(self, conn: _Connection, request_id: str, count: int, offset: int) -> None:
        rid = request_id.encode()
        lines = []
        n = len(self.tokens)
        for i in range(max(count, 1)):
            parts = self._line if i < count - 1 else self._last
            token = self.tokens[(offset + i) % n]
            lines.append(parts[0] + rid + parts[1] + token + parts[2])
        times = self.written.setdefault(request_id, []) if self.record_writes else None
        conn.start_chunked(200, "application/x-ndjson")
        self.streams += 1
        if self.token_interval_s <= 0:
            for i, line in enumerate(lines):
                conn.send_line(line, i == len(lines) - 1)
                if times is not None:
                    times.append(time.monotonic())
            return
        self.active += 1
        task = asyncio.get_running_loop().create_task(self._paced(conn, lines, times))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _paced(
        self, conn: _Connection, lines: list[bytes], times: list[float] | None
    ) -> None:
        try:
            for i, line in enumerate(lines):
                await asyncio.sleep(self.token_interval_s)
                if conn.closed:
                    return
                conn.send_line(line, i == len(lines) - 1)
                if times is not None:
                    times.append(time.monotonic())
        finally:
            self.active -= 1


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: requests answered in order (a streamed answer
    holds the connection until it ends, as HTTP/1.1 without pipelining does)."""

    def __init__(self, node: StandInNode) -> None:
        self.node = node
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.closed = False
        self.streaming = False
        self._head = b""  # a chunked answer's head, not yet written (see start_chunked)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.streaming:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._fail()
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for header in head[1:]:
                name, _, value = header.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if length > MAX_BODY:
                return self._fail()
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            method, path, _ = head[0].split(" ", 2)
            self.node.answer(self, method, path, body)

    def _fail(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _write_body(self, data: bytes) -> None:
        """Part of a chunked body, after its head if that has not gone out yet."""
        self._write(self._head + data)
        self._head = b""

    def send_body(self, status: int, body: bytes) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        self._write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)

    def send_json(self, status: int, obj: object) -> None:
        self.send_body(status, json.dumps(obj).encode())

    def start_chunked(self, status: int, content_type: str, with_first_chunk: bool = False) -> None:
        """The head of a chunked answer: written now (a decode node's headers say it took the
        request), or `with_first_chunk`, in the same write as that (a streamed prefill's
        headers go out with its KV handle's line, as the prefill node sends them)."""
        self.streaming = True
        head = f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
        self._head = f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
        if not with_first_chunk:
            self._write(self._head)
            self._head = b""

    def send_chunk(self, data: bytes) -> None:
        self._write_body(b"%x\r\n%s\r\n" % (len(data), data))

    def send_line(self, line: bytes, last: bool) -> None:
        """A stream's line; its last goes out with the body's end, as a node writes it."""
        if last:
            self.end_chunked(line)
        else:
            self.send_chunk(line)

    def end_chunked(self, last: bytes = b"") -> None:
        """The body's end, after its `last` chunk in the same write (if any)."""
        chunk = b"%x\r\n%s\r\n" % (len(last), last) if last else b""
        self._write_body(chunk + b"0\r\n\r\n")
        self.streaming = False
        if self.buf:
            self.data_received(b"")  # a request that came while this one streamed
