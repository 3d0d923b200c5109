"""The decode node: reserve destination blocks, pull the KV, decode, stream tokens.

POST /internal/decode reserves blocks for the prompt's KV (or answers 503
decode_full so the proxy keeps the request queued), asks the prefill node for
the KV with a TransferRequest, waits (bounded) for it to land, admits the
request into the running batch and streams its tokens as NDJSON. Destination
blocks are freed only when no write can land in them any more.

POST /internal/generate prefills a request here instead (conditional
disaggregation: the proxy sends a short or mostly cached prompt straight to a
decode node when that gives an earlier first token than the prefill pool).

POST /internal/kv_peers names prefill nodes' KV side channels; the node makes the
handshake with each one it does not know yet in the background (the proxy sends
them as it finds prefill nodes), so that a pair's first request does not wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

from aiohttp import web

from common.engine.engine import RequestError
from common.engine.scheduler import StepOutput
from common.node.server import (
    NodeConfig,
    NodeRuntime,
    json_message,
    ndjson_response,
    read_message,
    stream_outputs,
    write_error_line,
)
from common.node.transfer import TransferNode
from common.wire.errors import SERVER_ERROR, ApiError
from common.wire.messages import KVFirstToken
from common.wire.node_messages import DecodeRequest, KVPeers, KVPeersResult, NodeEvent
from common.wire.stage import Stage
from decode_node.incoming import IN_FLIGHT, Incoming, IncomingState
from kv_transfer import (
    HandshakeError,
    KVProgress,
    KVReceived,
    KVTransferAgent,
    MessageReceived,
    PeerLost,
    Quiescent,
    TransferEvent,
    TransferFailed,
    TransferLost,
    TransferRejected,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class DecodeNode(TransferNode):
    role = "decode"

    def __init__(self, config: NodeConfig, runtime: NodeRuntime, agent: KVTransferAgent) -> None:
        super().__init__(config, runtime, agent)
        self._peers: dict[str, str] = {}  # side-channel address -> peer id
        # Handshakes under way, by address: a request and a pre-connect (POST
        # /internal/kv_peers) to the same prefill node share one.
        self._connecting: dict[str, asyncio.Task[str]] = {}

    def release_all(self) -> None:
        for entry in self._pending():
            self._free(entry)

    def routes(self) -> list[web.RouteDef]:
        return [
            *super().routes(),
            web.post("/internal/decode", self.handle_decode),
            web.post("/internal/generate", self.handle_generate),  # local prefill
            web.post("/internal/kv_peers", self.handle_kv_peers),
        ]

    def transferring(self) -> int:
        return sum(1 for e in self._pending() if e.state is IncomingState.RECEIVING)

    def busy(self) -> bool:
        return super().busy() or bool(self._pending())

    def _entry(self, request_id: str) -> Incoming | None:
        """The request's incoming-KV record while the node owns its reservation."""
        record = self.engine.record(request_id)
        entry = record.transfer if record is not None else None
        return entry if isinstance(entry, Incoming) and entry.pending else None

    def _pending(self) -> list[Incoming]:
        entries = (r.transfer for r in self.engine.records())
        return [e for e in entries if isinstance(e, Incoming) and e.pending]

    # -- decode ------------------------------------------------------------------

    async def handle_decode(self, request: web.Request) -> web.StreamResponse:
        self.check_admitting()
        received = time.time()
        msg = await read_message(request, DecodeRequest)
        await self.front.compile_constraint(msg.sampling)
        # Everything the handle and the request claim is checked here, before any block is
        # reserved or any byte reaches the engine thread.
        self.engine.validate_prefilled(
            msg.prompt_token_ids, msg.first_token_id, msg.sampling, msg.kv.num_tokens,
            msg.kv.num_blocks,
        )  # fmt: skip
        blocks = await self.front.reserve(
            msg.request_id, msg.kv.num_tokens, msg.prompt_token_ids, msg.sampling.n
        )
        if blocks is None:
            raise ApiError(503, "decode node is full", type=SERVER_ERROR, code="decode_full")
        assert len(blocks) == msg.kv.num_blocks, (len(blocks), msg.kv)  # validate_prefilled
        loop = asyncio.get_running_loop()
        entry = Incoming(msg.request_id, len(blocks), loop.create_future())
        if msg.first_token_id is None:  # streamed KV: the token comes with it
            entry.first_token = loop.create_future()
            entry.first_token.add_done_callback(_retrieve)
        entry.events += [("decode received", received), ("decode reserved", time.time())]
        record = self.engine.record(msg.request_id)
        assert record is not None and record.transfer is None, msg.request_id
        record.transfer = entry
        entry.skip_blocks = record.num_cached_blocks
        if entry.skip_blocks:
            entry.events.append((f"decode cache hit {entry.skip_blocks} blocks", time.time()))
        # Headers go out once the blocks are reserved: the proxy's dispatcher moves
        # on to the next queued request while this one's KV is in flight.
        resp = ndjson_response()
        try:
            await resp.prepare(request)
            first_token = await self._receive(entry, msg, blocks)
        except ApiError as err:
            self._abandon(entry)
            self.metrics.requests.labels(outcome=err.code or "failed").inc()
            await write_error_line(resp, msg.request_id, err)
            return resp
        except BaseException:
            self._abandon(entry)
            raise
        outputs = self.front.decode_prefilled(
            msg.request_id, msg.prompt_token_ids, first_token, msg.sampling
        )
        self.metrics.requests.labels(outcome="admitted").inc()

        def first(out: StepOutput) -> list[NodeEvent]:
            return entry.events + self.engine_events(
                out, "decode", "decode admitted", "first decode token"
            )

        return await stream_outputs(
            request,
            msg.request_id,
            outputs,
            resp,
            first,
            self.metrics.token_gap.observe,
            msg.sampling.n,
        )

    async def _receive(self, entry: Incoming, msg: DecodeRequest, blocks: list[int]) -> int:
        """Pull the KV into `blocks`; once it landed (LANDED), the first token; else raise
        ApiError."""
        peer_id = await self._peer(msg.kv.side_channel)
        if entry.cancelled:
            raise ApiError(409, f"request {entry.request_id} was cancelled", code="cancelled")
        try:
            self.agent.request_transfer(
                peer_id,
                entry.request_id,
                blocks[entry.skip_blocks :],
                msg.kv.transfer_key,
                skip_blocks=entry.skip_blocks,
            )
        except TransferRejected as e:
            raise ApiError(
                502, f"KV transfer refused: {e}", type=SERVER_ERROR, code="kv_failed"
            ) from None
        entry.peer_id = peer_id
        entry.transition(IncomingState.RECEIVING)
        entry.events.append(("transfer start", time.time()))
        entry.progress_at = time.monotonic()
        landed = await self._until(entry, entry.done)
        if not landed:
            code = "cancelled" if entry.cancelled else "kv_failed"
            raise ApiError(
                409 if entry.cancelled else 502,
                f"KV transfer for {entry.request_id} ended: {entry.failure}",
                type=SERVER_ERROR,
                code=code,
            )
        landed_at = time.time()
        first_token = msg.first_token_id
        if entry.first_token is not None:  # streamed: the token may still be on its way
            first_token = await self._until(entry, entry.first_token)
            landed_at = time.time()  # both here (the token is sent before the last group)
            exposed = max(0.0, landed_at - entry.sampled_at)
            self.metrics.kv_exposed_seconds.observe(exposed)
            groups = entry.groups + 1  # (the last one landed with this)
            row = f"kv landed {exposed * 1e3:.1f} ms after the first token ({groups} groups)"
            entry.events.append((row, landed_at))
        assert first_token is not None
        entry.transition(IncomingState.LANDED)  # from here the blocks are the sequence's
        entry.events.append(("transfer done", landed_at))
        moved = len(blocks) - entry.skip_blocks
        nbytes = moved * self.engine.block_bytes
        entry.events.append((f"kv moved {moved} of {len(blocks)} blocks, {nbytes} B", time.time()))
        self.metrics.kv_blocks_cached.inc(entry.skip_blocks)
        self.metrics.kv_blocks_transferred.inc(moved)
        self.metrics.transfer_bytes.observe(nbytes)
        return first_token

    async def _until(self, entry: Incoming, future: asyncio.Future[T]) -> T:
        """`future`'s result, else a kv_timeout once nothing of the KV came for
        --kv-wait-timeout (streamed KV: each landed group is progress, so a long prompt may
        compute for longer than that)."""
        timeout = self.config.kv_wait_timeout_s
        while True:
            left = entry.progress_at + timeout - time.monotonic()
            try:
                return await asyncio.wait_for(asyncio.shield(future), max(0.0, left))
            except TimeoutError:
                if entry.progress_at + timeout > time.monotonic():
                    continue  # a group landed meanwhile
                self.metrics.kv_wait_timeouts.inc()
                raise ApiError(
                    504, "KV did not arrive in time", type=SERVER_ERROR, code="kv_timeout"
                ) from None

    async def _peer(self, address: str) -> str:
        """The peer id of the prefill node at side channel `address`, after a handshake the
        first time (shared with any other request or pre-connect waiting for it)."""
        peer_id = self._peers.get(address)
        if peer_id is not None:
            return peer_id
        # A request that is cancelled while it waits leaves the handshake to the others.
        return await asyncio.shield(self._handshake(address))

    def _handshake(self, address: str) -> asyncio.Task[str]:
        """The handshake with `address` under way, started if none is."""
        task = self._connecting.get(address)
        if task is None:
            task = self.spawn(self._connect(address), f"kv-connect {address}")
            self._connecting[address] = task
            task.add_done_callback(lambda t: self._connected(address, t))
        return task

    def _connected(self, address: str, task: asyncio.Task[str]) -> None:
        self._connecting.pop(address, None)
        if not task.cancelled():
            task.exception()  # retrieved: every request that waited has it already

    async def _connect(self, address: str) -> str:
        try:
            peer_id = await asyncio.wrap_future(self.agent.connect_async(address))
        except HandshakeError as e:
            raise ApiError(
                502, f"cannot reach prefill node: {e}", type=SERVER_ERROR, code="kv_handshake"
            ) from None
        self._peers[address] = peer_id
        return peer_id

    async def handle_kv_peers(self, request: web.Request) -> web.Response:
        """POST /internal/kv_peers: connect now to the prefill nodes named, so that their
        first request here does not wait for the handshake (~30 ms over UCX on loopback).
        Answers at once; a handshake that fails is logged, and a request from that node
        tries again."""
        msg = await read_message(request, KVPeers)
        known = self._peers.keys() | self._connecting.keys()
        new = [a for a in dict.fromkeys(msg.side_channels) if a not in known]
        for address in new:
            self._handshake(address).add_done_callback(self._preconnected)
        return json_message(KVPeersResult(connecting=len(new), known=len(known)))

    @staticmethod
    def _preconnected(task: asyncio.Task[str]) -> None:
        if task.cancelled():
            return
        if isinstance(e := task.exception(), ApiError):
            log.warning("pre-connecting to a prefill node: %s", e.message)
        elif e is None:
            log.info("connected to prefill peer %s ahead of its first request", task.result())

    # -- cancel and release ------------------------------------------------------

    async def cancel(self, request_id: str) -> Stage | None:
        entry = self._entry(request_id)
        if entry is None:
            record = self.engine.record(request_id)
            if record is not None and _freed(record.transfer):
                return None  # ended here already; its blocks are on their way back
            return await super().cancel(request_id)  # running: the engine aborts it
        if entry.state is IncomingState.RESERVED:
            entry.transition(IncomingState.CANCELLED)  # the handler stops before the transfer
            return Stage.RESERVED
        if entry.state is IncomingState.RECEIVING:
            entry.transition(IncomingState.CANCELLING)
            self.agent.abort(request_id)  # the handler returns on the terminal event
        return Stage.RESERVED if entry.state is IncomingState.CANCELLED else Stage.TRANSFER

    def _abandon(self, entry: Incoming) -> None:
        """The handler is gone (cancelled, timed out, failed): free when it is safe."""
        if not entry.pending:
            return
        if entry.quiescent or entry.state not in IN_FLIGHT:
            self._free(entry)  # nothing can write into the blocks any more
            return
        if entry.state is not IncomingState.ABANDONED:
            entry.transition(IncomingState.ABANDONED)
        self.agent.abort(entry.request_id)  # False: the terminal event is already queued

    def _free(self, entry: Incoming) -> None:
        if entry.pending:
            entry.transition(IncomingState.FREED)
            self.front.free_reserved(entry.request_id)

    # -- KV-transfer events --------------------------------------------------------

    def on_transfer_event(self, event: TransferEvent) -> None:
        match event:
            case KVReceived(request_id):
                self._terminal(request_id, True, "")
            case TransferFailed(request_id, _, reason, detail):
                self.metrics.transfer_failures.labels(reason=reason.value).inc()
                self._terminal(request_id, False, f"{reason.value} {detail}".strip())
            case Quiescent(request_id, _, landed):
                self._terminal(request_id, False, "aborted" + (" after landing" if landed else ""))
            case TransferLost(request_id, _, detail):
                entry = self._entry(request_id)
                if entry is not None and not entry.done.done():
                    entry.failure = f"peer_lost {detail} (its blocks are quarantined)"
                    entry.done.set_result(False)  # the handler gives up; blocks stay held
            case PeerLost(peer_id):
                self._peers = {a: p for a, p in self._peers.items() if p != peer_id}
            case KVProgress(request_id, _, landed, total):
                entry = self._entry(request_id)
                if entry is not None:
                    entry.groups += 1
                    entry.progress_at = time.monotonic()
                    self.metrics.kv_groups.inc()
                    row = f"kv group {entry.groups} moved: {landed} of {total} blocks landed"
                    entry.events.append((row, time.time()))
            case MessageReceived(peer_id, KVFirstToken() as msg):
                self._on_first_token(peer_id, msg)
            case _:
                pass

    def _on_first_token(self, peer_id: str, msg: KVFirstToken) -> None:
        """Streamed KV: accepted only for an expected transfer, from the peer that owns it,
        and only a token in the vocabulary."""
        entry = self._entry(msg.request_id)
        if entry is None or entry.first_token is None or entry.peer_id != peer_id:
            log.warning("first token for %s from %s refused: no such transfer from it",
                        msg.request_id, peer_id)  # fmt: skip
            return
        if entry.first_token.done():
            return
        try:
            self.engine.check_token(msg.token_id)
        except RequestError as e:  # the handler fails; the blocks go once quiescent
            log.warning("first token for %s from %s refused: %s", msg.request_id, peer_id, e)
            error = ApiError(502, f"bad first token: {e}", type=SERVER_ERROR, code="kv_failed")
            entry.first_token.set_exception(error)
            return
        entry.sampled_at = msg.sampled_at
        entry.progress_at = time.monotonic()
        entry.first_token.set_result(msg.token_id)

    def _terminal(self, request_id: str, landed: bool, failure: str) -> None:
        entry = self._entry(request_id)
        if entry is None:
            return
        entry.quiescent = True
        entry.failure = entry.failure or failure
        if entry.state is IncomingState.ABANDONED:
            self._free(entry)
        elif not entry.done.done():
            entry.done.set_result(landed)


def _retrieve(future: asyncio.Future[int]) -> None:
    """A first token's error is seen even if the transfer failed first (no GC warning)."""
    if not future.cancelled():
        future.exception()


def _freed(transfer: object) -> bool:
    return isinstance(transfer, Incoming) and transfer.state is IncomingState.FREED
