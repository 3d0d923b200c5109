"""Stand-in nodes for load-testing the proxy alone (`scripts/bench_proxy.py`).

A `StandInNode` speaks the nodes' internal HTTP API (`common.wire.node_messages`): `/health`,
`/state`, `/internal/{prefill,extend,decode,generate,cancel}`, and answers at once, with no
engine and no KV behind it. A prefill returns token `tokens[0]` and a KV handle nobody will
read; a decode (or generate) streams `max_tokens - 1` (or `max_tokens`) token lines from
`tokens`, one line per token as a real node writes them, the last one finishing "length".
`token_interval_s` paces the lines (0: as fast as the connection takes them). What a
benchmark measures through these nodes is the proxy's own cost, nothing about serving.

`written[request_id]` keeps when (time.monotonic()) each streamed line was written, while
`record_writes` is set, so a client in the same process can tell how long the proxy took to
relay each token.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Sequence

from aiohttp import web

from common.wire.messages import Cancel
from common.wire.node_messages import (
    CancelResult,
    DecodeRequest,
    GenerateRequest,
    KVHandle,
    LeaseExtend,
    LeaseExtendResult,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    from_json,
    to_json,
)

NDJSON = {"Content-Type": "application/x-ndjson"}
_MARK = 987654321  # a token id that cannot occur in a line's other fields


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
        self.tokens = list(tokens)
        self.fingerprint = fingerprint
        self.token_interval_s = token_interval_s
        self.max_num_seqs = max_num_seqs
        self.engine_id = f"standin-{role}-{uuid.uuid4().hex[:6]}"
        self.record_writes = False
        self.written: dict[str, list[float]] = {}
        self.active = 0
        self.streams = 0  # streams started, over the node's life
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/state", self.state),
                web.post("/internal/prefill", self.prefill),
                web.post("/internal/extend", self.extend),
                web.post("/internal/decode", self.decode),
                web.post("/internal/generate", self.generate),
                web.post("/internal/cancel", self.cancel),
            ]
        )
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": self.role})

    async def state(self, request: web.Request) -> web.Response:
        free = 1_000_000
        return web.json_response(
            {
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
        )

    async def prefill(self, request: web.Request) -> web.Response:
        msg = from_json(await request.read(), PrefillRequest)
        kv = KVHandle(
            engine_id=self.engine_id,
            side_channel="tcp://127.0.0.1:1",  # never dialled: the decode stand-in reads no KV
            num_blocks=1 + len(msg.prompt_token_ids) // 16,
            num_tokens=len(msg.prompt_token_ids),
            lease_deadline=time.time() + msg.lease_s,
            transfer_key=secrets.token_hex(16),
        )
        one = msg.sampling.max_tokens is not None and msg.sampling.max_tokens <= 1
        result = PrefillResult(
            request_id=msg.request_id,
            first_token_id=self.tokens[0],
            finish_reason="length" if one else None,
            kv=None if one else kv,
        )
        return web.Response(body=to_json(result), content_type="application/json")

    async def extend(self, request: web.Request) -> web.Response:
        msg = from_json(await request.read(), LeaseExtend)
        result = LeaseExtendResult(extended=list(msg.request_ids), missing=[])
        return web.Response(body=to_json(result), content_type="application/json")

    async def cancel(self, request: web.Request) -> web.Response:
        msg = from_json(await request.read(), Cancel)
        result = CancelResult(request_id=msg.request_id, found=False)
        return web.Response(body=to_json(result), content_type="application/json")

    async def decode(self, request: web.Request) -> web.StreamResponse:
        msg = from_json(await request.read(), DecodeRequest)
        return await self._stream(request, msg.request_id, (msg.sampling.max_tokens or 16) - 1, 1)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        msg = from_json(await request.read(), GenerateRequest)
        return await self._stream(request, msg.request_id, msg.sampling.max_tokens or 16, 0)

    async def _stream(
        self, request: web.Request, request_id: str, count: int, offset: int
    ) -> web.StreamResponse:
        """`count` token lines, the last one finishing; `offset`: tokens already sent."""
        head, tail = to_json(TokenDelta(request_id=request_id, token_ids=[_MARK])).split(
            str(_MARK).encode()
        )
        last = to_json(TokenDelta(request_id=request_id, token_ids=[_MARK], finish_reason="length"))
        last_head, last_tail = last.split(str(_MARK).encode())
        times = self.written.setdefault(request_id, []) if self.record_writes else None
        resp = web.StreamResponse(headers=NDJSON)
        self.active += 1
        self.streams += 1
        try:
            await resp.prepare(request)
            n = len(self.tokens)
            for i in range(count):
                if self.token_interval_s > 0:
                    await asyncio.sleep(self.token_interval_s)
                token = str(self.tokens[(offset + i) % n]).encode()
                if i < count - 1:
                    await resp.write(head + token + tail + b"\n")
                else:
                    await resp.write(last_head + token + last_tail + b"\n")
                if times is not None:
                    times.append(time.monotonic())
            await resp.write_eof()
        finally:
            self.active -= 1
        return resp
