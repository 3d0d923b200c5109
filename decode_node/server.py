"""The decode node: reserve destination blocks, pull the KV, decode, stream tokens.

POST /internal/decode reserves blocks for the prompt's KV (or answers 503
decode_full so the proxy keeps the request queued), asks the prefill node for
the KV with a TransferRequest, waits (bounded) for it to land, admits the
request into the running batch and streams its tokens as NDJSON. Destination
blocks are freed only when no write can land in them any more.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from common.engine.scheduler import StepOutput
from common.node.server import ndjson_response, read_message, stream_outputs, write_error_line
from common.node.transfer import TransferNode
from common.wire.errors import SERVER_ERROR, ApiError, invalid_request
from common.wire.node_messages import DecodeRequest, NodeEvent
from decode_node.incoming import Incoming, InState
from kv_transfer import (
    HandshakeError,
    KVReceived,
    PeerLost,
    Quiescent,
    TransferEvent,
    TransferFailed,
    TransferRejected,
)

log = logging.getLogger(__name__)


class DecodeNode(TransferNode):
    role = "decode"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.incoming: dict[str, Incoming] = {}
        self._peers: dict[str, str] = {}  # side-channel address -> peer id

    def release_all(self) -> None:
        for entry in list(self.incoming.values()):
            self._free(entry)

    def routes(self) -> list[web.RouteDef]:
        return [*super().routes(), web.post("/internal/decode", self.handle_decode)]

    def transferring(self) -> int:
        return sum(1 for e in self.incoming.values() if e.state is InState.RECEIVING)

    def busy(self) -> bool:
        return super().busy() or bool(self.incoming)

    # -- decode ------------------------------------------------------------------

    async def handle_decode(self, request: web.Request) -> web.StreamResponse:
        self.check_admitting()
        received = time.time()
        msg = await read_message(request, DecodeRequest)
        assert self.engine is not None and self.front is not None
        self.engine.validate(msg.prompt_token_ids, msg.sampling)
        blocks = self.engine.reserve(msg.request_id, msg.kv.num_tokens)
        if blocks is None:
            raise ApiError(503, "decode node is full", type=SERVER_ERROR, code="decode_full")
        if len(blocks) != msg.kv.num_blocks:
            self.engine.free_reserved(msg.request_id)
            raise invalid_request(
                f"the prefill node holds {msg.kv.num_blocks} blocks for {msg.kv.num_tokens} "
                f"tokens; this node needs {len(blocks)} (block sizes differ?)"
            )
        entry = Incoming(msg.request_id, blocks, asyncio.get_running_loop().create_future())
        entry.events += [("decode received", received), ("decode reserved", time.time())]
        self.incoming[msg.request_id] = entry
        # Headers go out once the blocks are reserved: the proxy's dispatcher moves
        # on to the next queued request while this one's KV is in flight.
        resp = ndjson_response()
        try:
            await resp.prepare(request)
            await self._receive(entry, msg)
        except ApiError as err:
            self._abandon(entry)
            self.metrics.requests.labels(outcome=err.code or "failed").inc()
            await write_error_line(resp, msg.request_id, err)
            return resp
        except BaseException:
            self._abandon(entry)
            raise
        del self.incoming[msg.request_id]
        outputs = self.front.decode_prefilled(
            msg.request_id, msg.prompt_token_ids, msg.first_token_id, msg.sampling
        )
        self.metrics.requests.labels(outcome="admitted").inc()

        def first(out: StepOutput) -> list[NodeEvent]:
            return entry.events + self.engine_events(
                out, "decode", "decode admitted", "first decode token"
            )

        return await stream_outputs(request, msg.request_id, outputs, resp, first)

    async def _receive(self, entry: Incoming, msg: DecodeRequest) -> None:
        """Pull the KV into entry.blocks; return once it landed, else raise ApiError."""
        assert self.agent is not None
        peer_id = await self._peer(msg.kv.side_channel)
        if entry.cancelled:
            raise ApiError(409, f"request {entry.request_id} was cancelled", code="cancelled")
        try:
            self.agent.request_transfer(peer_id, entry.request_id, entry.blocks)
        except TransferRejected as e:
            raise ApiError(
                502, f"KV transfer refused: {e}", type=SERVER_ERROR, code="kv_failed"
            ) from None
        entry.peer_id = peer_id
        entry.transition(InState.RECEIVING)
        entry.events.append(("transfer start", time.time()))
        try:
            landed = await asyncio.wait_for(
                asyncio.shield(entry.done), self.config.kv_wait_timeout_s
            )
        except TimeoutError:
            self.metrics.kv_wait_timeouts.inc()
            raise ApiError(
                504, "KV did not arrive in time", type=SERVER_ERROR, code="kv_timeout"
            ) from None
        if not landed:
            code = "cancelled" if entry.cancelled else "kv_failed"
            raise ApiError(
                409 if entry.cancelled else 502,
                f"KV transfer for {entry.request_id} ended: {entry.failure}",
                type=SERVER_ERROR,
                code=code,
            )
        entry.transition(InState.LANDED)
        entry.events.append(("transfer done", time.time()))

    async def _peer(self, address: str) -> str:
        assert self.agent is not None
        peer_id = self._peers.get(address)
        if peer_id is None:
            try:
                peer_id = await asyncio.wrap_future(self.agent.connect_async(address))
            except HandshakeError as e:
                raise ApiError(
                    502, f"cannot reach prefill node: {e}", type=SERVER_ERROR, code="kv_handshake"
                ) from None
            self._peers[address] = peer_id
        return peer_id

    # -- cancel and release ------------------------------------------------------

    async def cancel(self, request_id: str) -> str | None:
        entry = self.incoming.get(request_id)
        if entry is None:
            return await super().cancel(request_id)  # running: the engine aborts it
        entry.cancelled = True
        if entry.state is InState.RECEIVING:
            assert self.agent is not None
            self.agent.abort(request_id)  # the handler returns on the terminal event
            return "transfer"
        return "reserved"

    def _abandon(self, entry: Incoming) -> None:
        """The handler is gone (cancelled, timed out, failed): free when it is safe."""
        if entry.state is InState.FREED:
            return
        if entry.done.done() or entry.state is InState.RESERVED:
            self._free(entry)  # nothing can write into the blocks any more
            return
        entry.abandoned = True
        assert self.agent is not None
        self.agent.abort(entry.request_id)  # False: the terminal event is already queued

    def _free(self, entry: Incoming) -> None:
        assert self.engine is not None
        self.incoming.pop(entry.request_id, None)
        if entry.state is not InState.FREED:
            entry.transition(InState.FREED)
            self.engine.free_reserved(entry.request_id)

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
            case PeerLost(peer_id):
                self._peers = {a: p for a, p in self._peers.items() if p != peer_id}
            case _:
                pass

    def _terminal(self, request_id: str, landed: bool, failure: str) -> None:
        entry = self.incoming.get(request_id)
        if entry is None:
            return
        entry.failure = failure
        if entry.abandoned:
            self._free(entry)
        elif not entry.done.done():
            entry.done.set_result(landed)
