"""Test doubles for the nodes' internal HTTP API (common.wire.node_messages), on 127.0.0.1.

A `StubNode` answers /health, /state, /internal/{prefill,extend,decode,generate,cancel} with
simple scripted behaviour and records every call, so tests can check what the proxy sent and
when. It stands in for the HTTP contract only: no engine, no KV. Tests run their coroutines
with `run(...)` (a fresh event loop, bounded in time).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry

from common.wire.messages import Cancel, Message
from common.wire.node_messages import (
    CancelResult,
    DecodeRequest,
    GenerateRequest,
    KVHandle,
    KVPeers,
    KVPeersResult,
    LeaseExtend,
    LeaseExtendResult,
    PrefillAccepted,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    from_json,
    to_json,
)
from common.wire.sampling_params import SamplingParams
from proxy.metrics import InterStageMetrics
from proxy.pool.client import NodeClient, NodeTimeouts
from proxy.pool.interstage import InterStageConfig, InterStageQueue
from proxy.pool.registry import NodeRegistry, RegistryConfig

T = TypeVar("T")
NDJSON = {"Content-Type": "application/x-ndjson"}


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run `coro` on a new event loop; fail instead of hanging."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def eventually(check: Callable[[], bool], timeout: float = 3.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.01)


class StubNode:
    """One scripted node. Attributes set the behaviour; lists record the calls."""

    def __init__(self, role: str, fingerprint: str = "fp-A") -> None:
        self.role = role
        self.fingerprint = fingerprint
        self.engine_id = ""
        self.port = 0
        self.health_status = 200
        self.queued_prefill_tokens = 0
        self.free_blocks = 100
        self.max_num_seqs = 8
        # prefill
        self.first_token = 7
        self.prefill_delay = 0.0
        self.finish_at_first: str | None = None
        self.streamed_result_line: bytes | None = None  # sent instead of the PrefillResult
        self.refuse_prefill = False  # answer 400, as a node does for a request it cannot take
        self.extend_missing: set[str] = set()
        # decode / generate
        self.tokens = [8, 9, 10]
        self.token_delay = 0.0
        self.decode_full_times = 0  # the next N decode requests get 503 decode_full
        self.max_streams: int | None = None  # decode_full while this many streams are open
        self.hold_streams = False  # streams wait for `release(request_id)` before tokens
        self.accept_delay = 0.0  # decode: seconds before answering (full or accepted)
        self.step_time_max_s: float | None = None  # reported in /state
        self.prefill_tokens_per_s: float | None = None  # reported in /state
        self.epoch = 0  # role changes (reported in /state, with role_state)
        self.side_channel = ""  # reported in /state's kv_transfer ("": none)
        self.kv_peers_status = 200  # POST /internal/kv_peers answers this
        self.role_state = "serving"
        # hang(): like SIGSTOP, connections are accepted but nothing answers or streams
        self._running = asyncio.Event()
        self._running.set()
        # hang_polls(): only GET /health and /state go unanswered (a stuck poll connection)
        self._polls_answered = asyncio.Event()
        self._polls_answered.set()
        # records
        self.calls: list[tuple[str, Any]] = []
        self.accepted: list[str] = []  # decode/generate requests streamed, in order
        self.offers_open = 0  # decode requests being answered now
        self.offers_open_max = 0
        self.cancels: list[str] = []
        self.extends: list[list[str]] = []
        self.disconnected: list[str] = []  # handlers the proxy dropped before they finished
        self.active: set[str] = set()
        self._gates: dict[str, asyncio.Event] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> str:
        self.engine_id = f"{self.role}-{uuid.uuid4().hex[:6]}"
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/state", self.state),
                web.post("/internal/prefill", self.prefill),
                web.post("/internal/prefill_streamed", self.prefill_streamed),
                web.post("/internal/extend", self.extend),
                web.post("/internal/decode", self.decode),
                web.post("/internal/generate", self.generate),
                web.post("/internal/cancel", self.cancel),
                web.post("/internal/kv_peers", self.kv_peers),
            ]
        )
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def hang(self) -> None:
        """Stop answering anything (a stopped process: TCP still accepts) until `resume()`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def hang_polls(self, hang: bool = True) -> None:
        """Leave polls (GET /health, /state) unanswered while everything else works."""
        if hang:
            self._polls_answered.clear()
        else:
            self._polls_answered.set()

    def release(self, request_id: str) -> None:
        self._gates.setdefault(request_id, asyncio.Event()).set()

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    # -- handlers ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        await self._running.wait()
        await self._polls_answered.wait()
        return web.json_response({"status": "ok", "role": self.role}, status=self.health_status)

    async def state(self, request: web.Request) -> web.Response:
        await self._running.wait()
        await self._polls_answered.wait()
        return web.json_response(
            {
                "role": self.role,
                "engine_id": self.engine_id,
                "model_fingerprint": self.fingerprint,
                "blocks": {"total": 100, "free": self.free_blocks, "used": 0, "held": 0},
                "requests": {"waiting": 0, "running": len(self.active), "transferring": 0},
                "capacity": {
                    "max_num_seqs": self.max_num_seqs,
                    "running": len(self.active),
                    "reserved": 0,
                    "free_blocks": self.free_blocks,
                    "block_size": 16,
                },
                "queued_prefill_tokens": self.queued_prefill_tokens,
                "step_time_max_s": self.step_time_max_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "epoch": self.epoch,
                "role_state": self.role_state,
                "switchable": self.role != "both",
                **(
                    {"kv_transfer": {"side_channel": self.side_channel}}
                    if self.side_channel
                    else {}
                ),
            }
        )

    async def prefill(self, request: web.Request) -> web.Response:
        msg = await self._read(request, PrefillRequest)
        if msg.epoch is not None and msg.epoch != self.epoch:  # as a node that changed role
            error = {"message": "stale epoch", "type": "invalid_request_error"}
            return web.json_response({"error": {**error, "param": None, "code": "stale_epoch"}},
                                     status=409)  # fmt: skip
        if self.refuse_prefill:
            error = {"message": "prompt too long", "type": "invalid_request_error"}
            return web.json_response({"error": {**error, "param": None, "code": None}}, status=400)
        try:
            await asyncio.sleep(self.prefill_delay)
        except asyncio.CancelledError:
            self.disconnected.append(msg.request_id)
            raise
        if self.finish_at_first is not None:
            result = PrefillResult(
                request_id=msg.request_id,
                first_token_id=self.first_token,
                finish_reason=self.finish_at_first,
                kv=None,
            )
            return _json(result)
        kv = self._handle(msg)
        result = PrefillResult(
            request_id=msg.request_id, first_token_id=self.first_token, finish_reason=None, kv=kv
        )
        return _json(result)

    async def prefill_streamed(self, request: web.Request) -> web.StreamResponse:
        """The handle at once, the result after `prefill_delay` (`streamed_result_line`
        instead, when set: a node's error line, or garbage)."""
        msg = await self._read(request, PrefillRequest)
        resp = web.StreamResponse(headers=NDJSON)
        await resp.prepare(request)
        kv = self._handle(msg)
        await resp.write(to_json(PrefillAccepted(request_id=msg.request_id, kv=kv)) + b"\n")
        try:
            await asyncio.sleep(self.prefill_delay)
        except asyncio.CancelledError:
            self.disconnected.append(msg.request_id)
            raise
        finished = self.finish_at_first is not None
        result = PrefillResult(
            request_id=msg.request_id, first_token_id=self.first_token,
            finish_reason=self.finish_at_first, kv=None if finished else kv,
        )  # fmt: skip
        line = self.streamed_result_line or to_json(result) + b"\n"
        await resp.write(line)
        await resp.write_eof()
        return resp

    def _handle(self, msg: PrefillRequest) -> KVHandle:
        return KVHandle(
            engine_id=self.engine_id,
            side_channel="tcp://127.0.0.1:1",
            num_blocks=1,
            num_tokens=len(msg.prompt_token_ids),
            lease_deadline=time.time() + msg.lease_s,
            transfer_key="stub-transfer-key-0123",
        )

    async def extend(self, request: web.Request) -> web.Response:
        msg = await self._read(request, LeaseExtend)
        self.extends.append(list(msg.request_ids))
        missing = [r for r in msg.request_ids if r in self.extend_missing]
        extended = [r for r in msg.request_ids if r not in self.extend_missing]
        return _json(LeaseExtendResult(extended=extended, missing=missing))

    async def decode(self, request: web.Request) -> web.StreamResponse:
        msg = await self._read(request, DecodeRequest)
        self.offers_open += 1
        self.offers_open_max = max(self.offers_open_max, self.offers_open)
        try:
            await asyncio.sleep(self.accept_delay)
        finally:
            self.offers_open -= 1
        full = self.max_streams is not None and len(self.active) >= self.max_streams
        if self.decode_full_times > 0 or full:
            self.decode_full_times = max(0, self.decode_full_times - 1)
            error = {
                "message": "decode node is full",
                "type": "server_error",
                "code": "decode_full",
            }
            return web.json_response({"error": {**error, "param": None}}, status=503)
        return await self._stream(request, msg.request_id, list(self.tokens))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        msg = await self._read(request, GenerateRequest)
        return await self._stream(request, msg.request_id, [self.first_token, *self.tokens])

    async def kv_peers(self, request: web.Request) -> web.Response:
        msg = await self._read(request, KVPeers)
        if self.kv_peers_status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.kv_peers_status)
        return _json(KVPeersResult(connecting=len(msg.side_channels), known=0))

    async def cancel(self, request: web.Request) -> web.Response:
        msg = await self._read(request, Cancel)
        self.cancels.append(msg.request_id)
        return _json(CancelResult(request_id=msg.request_id, found=True))

    async def _stream(
        self, request: web.Request, request_id: str, tokens: list[int]
    ) -> web.StreamResponse:
        self.accepted.append(request_id)
        self.active.add(request_id)
        resp = web.StreamResponse(headers=NDJSON)
        try:
            await resp.prepare(request)
            if self.hold_streams:
                await self._gates.setdefault(request_id, asyncio.Event()).wait()
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.token_delay)
                await self._running.wait()
                reason = "length" if i == len(tokens) - 1 else None
                delta = TokenDelta(request_id=request_id, token_ids=[token], finish_reason=reason)
                await resp.write(to_json(delta) + b"\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionError):
            self.disconnected.append(request_id)
            raise
        finally:
            self.active.discard(request_id)
        return resp

    async def _read(self, request: web.Request, cls: type[Any]) -> Any:
        await self._running.wait()
        msg = from_json(await request.read(), cls)
        self.calls.append((request.path, msg))
        return msg


def _json(msg: Message) -> web.Response:
    return web.Response(body=to_json(msg), content_type="application/json")


@contextlib.asynccontextmanager
async def stubs(*nodes: StubNode) -> AsyncIterator[tuple[StubNode, ...]]:
    """Start `nodes`; always stop them."""
    try:
        for node in nodes:
            await node.start()
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


# -- the proxy's node-facing parts, wired as proxy.main wires them ------------------------------


@dataclass
class Stack:
    client: NodeClient
    registry: NodeRegistry
    queue: InterStageQueue
    metrics: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.get_sample_value(name, labels or None) or 0.0


FAST = NodeTimeouts(connect_s=1.0, control_s=2.0, first_byte_s=5.0, read_line_s=5.0)


@contextlib.asynccontextmanager
async def proxy_stack(
    prefill: tuple[StubNode, ...] = (),
    decode: tuple[StubNode, ...] = (),
    poll_interval_s: float = 0.05,
    timeouts: NodeTimeouts = FAST,
    silent_after_s: float | None = None,
    **queue_config: Any,
) -> AsyncIterator[Stack]:
    """Client, registry (nodes added as from flags) and inter-stage queue, started; always
    stopped."""
    client = NodeClient(timeouts)
    config_r = RegistryConfig(poll_interval_s=poll_interval_s, silent_after_s=silent_after_s)
    registry = NodeRegistry(client, config_r)
    for node in prefill:
        registry.add(node.url, "prefill")
    for node in decode:
        registry.add(node.url, "decode")
    metrics = CollectorRegistry()
    config = InterStageConfig(**queue_config)
    queue = InterStageQueue(registry, client, InterStageMetrics(metrics), config)
    registry.add_listener(lambda node: queue.notify_capacity())
    await client.start()
    try:
        await registry.start()
        await queue.start()
        yield Stack(client, registry, queue, metrics)
    finally:
        await queue.stop()
        await registry.stop()
        await client.close()


def decode_request(request_id: str, prompt: list[int] | None = None) -> DecodeRequest:
    prompt = prompt or [1, 2, 3]
    kv = KVHandle(
        engine_id="prefill-stub",
        side_channel="tcp://127.0.0.1:1",
        num_blocks=1,
        num_tokens=len(prompt),
        lease_deadline=time.time() + 30,
        transfer_key="stub-transfer-key-0123",
    )
    return DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        first_token_id=7,
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
        kv=kv,
    )
