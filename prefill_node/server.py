"""The prefill node: prompt in, first token and a KV handle out; KV written to decode.

POST /internal/prefill runs the prompt through the engine with `hold_kv`: the
engine samples the first token and keeps the prompt's KV blocks HELD in the
request's record. The node puts them under a lease (`HeldKV`, attached to that
record) and answers with a KVHandle. A
decode node then sends a TransferRequest over the KV-transfer side channel; the
node WRITEs the held blocks into the named destination blocks and frees its own
only when the transfer reports a terminal event (done, failed, quiescent).

POST /internal/prefill_streamed streams the KV while the prompt computes (`streamed.py`):
it answers NDJSON, a PrefillAccepted with the KV handle as soon as the engine computed the
first chunk (so the proxy can engage a decode node while the rest computes), then the
PrefillResult.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import web

from common.engine.scheduler import OutputKind, StepOutput
from common.engine.sequence import FinishReason
from common.node.server import (
    NodeConfig,
    NodeRuntime,
    json_message,
    ndjson_response,
    read_message,
    write_error_line,
)
from common.node.transfer import TransferNode
from common.wire.errors import ApiError
from common.wire.messages import KVAborted, TransferRequest
from common.wire.node_messages import (
    KVHandle,
    LeaseExtend,
    LeaseExtendResult,
    NodeEvent,
    PrefillAccepted,
    PrefillRequest,
    PrefillResult,
    to_json,
)
from common.wire.stage import Stage
from kv_transfer import (
    KVTransferAgent,
    MessageReceived,
    Quiescent,
    TransferDone,
    TransferEvent,
    TransferFailed,
    TransferRejected,
)
from prefill_node.held import HeldKV, HeldState
from prefill_node.lease import Lease
from prefill_node.streamed import KVStreamer, first_token

log = logging.getLogger(__name__)


class PrefillNode(TransferNode):
    role = "prefill"

    def __init__(self, config: NodeConfig, runtime: NodeRuntime, agent: KVTransferAgent) -> None:
        super().__init__(config, runtime, agent)
        delay = config.debug_transfer_delay_s
        self.streamer = KVStreamer(agent, self.metrics, self._refused, self.spawn, delay)

    def start_role(self) -> None:
        super().start_role()
        self.spawn(self._reap_leases(), "lease-reaper")

    def release_all(self) -> None:
        for entry in self._held():
            self._release(entry, "shutdown")

    def routes(self) -> list[web.RouteDef]:
        return [
            *super().routes(),
            web.post("/internal/prefill", self.handle_prefill),
            web.post("/internal/prefill_streamed", self.handle_prefill_streamed),
            web.post("/internal/extend", self.handle_extend),
        ]

    def transferring(self) -> int:
        return sum(1 for e in self._held() if e.sending)

    def busy(self) -> bool:
        return super().busy() or bool(self._held())

    def _entry(self, request_id: str) -> HeldKV | None:
        """The request's held-KV record, unless it was released."""
        record = self.engine.record(request_id)
        entry = record.transfer if record is not None else None
        if isinstance(entry, HeldKV) and entry.state is not HeldState.RELEASED:
            return entry
        return None

    def _held(self) -> list[HeldKV]:
        entries = (r.transfer for r in self.engine.records())
        return [e for e in entries if isinstance(e, HeldKV) and e.state is not HeldState.RELEASED]

    # -- prefill -----------------------------------------------------------------

    async def handle_prefill(self, request: web.Request) -> web.Response:
        self.check_admitting()
        received = time.time()
        msg = await read_message(request, PrefillRequest)
        await self.front.compile_constraint(msg.sampling)
        outputs = self.front.generate(
            msg.request_id, msg.prompt_token_ids, msg.sampling, hold_kv=True
        )
        final: StepOutput | None = None
        events: list[NodeEvent] = [("prefill received", received)]
        try:
            async for out in outputs:  # exactly one output: the first token (or an abort)
                final = out
                if out.times is not None:
                    events += self.engine_events(out, "prefill", "prefill admitted", "prefill done")
                if out.kind is OutputKind.HELD:
                    # No await between the engine's hold and this: a cancelled handler
                    # either never saw the hold (the engine frees it on abort) or holds it.
                    self._hold(msg, out)
        finally:
            await outputs.aclose()
        assert final is not None
        if final.finish_reason is FinishReason.ABORT:
            self.metrics.requests.labels(outcome="cancelled").inc()
            raise ApiError(409, f"request {msg.request_id} was cancelled", code="cancelled")
        self.metrics.requests.labels(outcome="prefilled").inc()
        result = self._result(msg, final)
        if result.kv is not None:
            events.append(("held", time.time()))
        return json_message(result.model_copy(update={"events": events}))

    def _hold(self, msg: PrefillRequest, out: StepOutput) -> None:
        """Put the request's HELD blocks under a lease: attach a HeldKV to its record."""
        assert out.held_blocks is not None
        record = self.engine.record(msg.request_id)
        assert record is not None and record.transfer is None, msg.request_id
        lease = Lease.grant(msg.request_id, out.held_blocks, msg.lease_s)
        n = len(out.held_blocks)
        record.transfer = HeldKV(msg.request_id, n, len(msg.prompt_token_ids), lease)

    def _result(self, msg: PrefillRequest, out: StepOutput) -> PrefillResult:
        (token,) = out.new_token_ids
        first_logprobs = out.logprobs[0] if out.logprobs else None
        entry = self._entry(msg.request_id)
        if entry is None or out.kind is not OutputKind.HELD:  # finished at its first token
            reason = out.finish_reason.wire_name if out.finish_reason is not None else None
            return PrefillResult(
                request_id=msg.request_id,
                first_token_id=token,
                finish_reason=reason,
                kv=None,
                num_cached_tokens=out.num_cached_tokens or 0,
                first_logprobs=first_logprobs,
                prompt_logprobs=out.prompt_logprobs,
            )
        return PrefillResult(
            request_id=msg.request_id,
            first_token_id=token,
            finish_reason=None,
            kv=self._handle(entry),
            num_cached_tokens=out.num_cached_tokens or 0,
            first_logprobs=first_logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )

    def _handle(self, entry: HeldKV) -> KVHandle:
        return KVHandle(
            engine_id=self.engine_id,
            side_channel=self.agent.address,
            num_blocks=entry.num_blocks,
            num_tokens=entry.num_tokens,
            lease_deadline=time.time() + entry.lease.remaining(),
            transfer_key=entry.transfer_key,
        )

    # -- streamed prefill ----------------------------------------------------------

    async def handle_prefill_streamed(self, request: web.Request) -> web.StreamResponse:
        self.check_admitting()
        received = time.time()
        msg = await read_message(request, PrefillRequest)
        await self.front.compile_constraint(msg.sampling)
        n = len(msg.prompt_token_ids)
        lease = Lease.grant(msg.request_id, [], msg.lease_s)
        entry = HeldKV.streamed(msg.request_id, -(-n // self.engine.config.block_size), n, lease)
        outputs = self.front.generate(
            msg.request_id, msg.prompt_token_ids, msg.sampling, True, True, transfer=entry
        )
        events: list[NodeEvent] = [("prefill received", received)]
        resp = ndjson_response(with_first_line=True)  # prepared with the KV handle's line
        final: StepOutput | None = None
        try:
            async for out in outputs:
                # The handle goes out with the first output (the first chunk computed): the
                # decode node reserves for a prompt that computes, not one still queued here.
                if not resp.prepared and out.finish_reason is not FinishReason.ABORT:
                    await resp.prepare(request)
                    accepted = PrefillAccepted(request_id=msg.request_id, kv=self._handle(entry))
                    await resp.write(to_json(accepted) + b"\n")
                if out.times is not None:
                    events += self.engine_events(out, "prefill", "prefill admitted", "prefill done")
                if out.kind is not OutputKind.KV_COMPUTED:
                    final = out
                self._on_streamed(msg, entry, out)
        finally:
            await outputs.aclose()
            if entry.computing:  # the call ended before the first token (cancelled, failed)
                self._stop_streamed(entry, "the prefill call ended")
        assert final is not None
        if final.finish_reason is FinishReason.ABORT:
            self.metrics.requests.labels(outcome="cancelled").inc()
            err = ApiError(409, f"request {msg.request_id} was cancelled", code="cancelled")
            if not resp.prepared:
                raise err
            await write_error_line(resp, msg.request_id, err)
            return resp
        self.metrics.requests.labels(outcome="prefilled").inc()
        result = self._result(msg, final)
        if final.kind is OutputKind.HELD:
            result = result.model_copy(update={"kv": self._handle(entry)})
            events.append(("held" if entry.state is HeldState.HELD else "streaming", time.time()))
        await resp.write_eof(to_json(result.model_copy(update={"events": events})) + b"\n")
        return resp

    def _on_streamed(self, msg: PrefillRequest, entry: HeldKV, out: StepOutput) -> None:
        """One engine output of a streamed prefill (no await: the engine's order holds)."""
        assert entry.stream is not None
        if out.kind is OutputKind.KV_COMPUTED:
            assert out.computed_blocks is not None
            self.streamer.computed(entry, out.computed_blocks)
        elif out.kind is OutputKind.HELD:
            assert out.held_blocks is not None
            (entry.stream.first_token,) = out.new_token_ids
            entry.stream.sampled_at = time.time()
            if entry.state is HeldState.COMPUTING:  # nobody asked yet: hold, leased
                ttl = max(msg.lease_s, entry.lease.remaining())
                entry.lease = Lease.grant(msg.request_id, out.held_blocks, ttl)
                entry.transition(HeldState.HELD)
            elif entry.state is HeldState.STREAMING:
                self.streamer.last(entry, out.held_blocks)
        elif out.finished and out.finish_reason is not FinishReason.ABORT and entry.computing:
            self._stop_streamed(entry, "finished at its first token")

    def _stop_streamed(self, entry: HeldKV, why: str) -> None:
        """End a streamed prefill still computing: the engine stops it; its blocks go once
        no write can read them (at once, or when the open write is quiescent)."""
        if entry.state is HeldState.STREAMING and entry.stream and entry.stream.opened:
            self.front.abort(entry.request_id)
            entry.transition(HeldState.CANCELLING)
            self.agent.abort(entry.request_id)  # (False: its terminal event is queued)
            return
        if entry.state is HeldState.STREAMING and entry.peer_id is not None:
            self._tell_aborted(entry.peer_id, entry.request_id, why)
        self._release(entry, why)

    def _refused(self, entry: HeldKV, why: str) -> None:
        """A streamed write could not be opened: nothing was posted."""
        if entry.peer_id is not None:
            self._tell_aborted(entry.peer_id, entry.request_id, why)
        self._release(entry, why)

    async def handle_extend(self, request: web.Request) -> web.Response:
        msg = await read_message(request, LeaseExtend)
        extended, missing = [], []
        for rid in msg.request_ids:
            entry = self._entry(rid)
            if entry is not None and entry.computing:  # leased from its first token on
                if entry.state is HeldState.COMPUTING:
                    entry.lease = Lease.grant(rid, [], msg.lease_s)
                extended.append(rid)
                continue
            if entry is None or entry.state is not HeldState.HELD or entry.lease.expired():
                missing.append(rid)
                continue
            entry.lease = entry.lease.extend(msg.lease_s)
            extended.append(rid)
        return json_message(LeaseExtendResult(extended=extended, missing=missing))

    # -- cancel, expiry, release ---------------------------------------------------

    async def cancel(self, request_id: str) -> Stage | None:
        entry = self._entry(request_id)
        if entry is None:
            record = self.engine.record(request_id)
            if record is not None and record.transfer is not None and record.seq is None:
                return None  # released already; the engine is freeing its blocks
            return await super().cancel(request_id)  # queued or computing: the engine aborts it
        if entry.computing:  # a streamed prefill
            streaming = entry.state is HeldState.STREAMING
            stage = self.engine.stage_of(request_id) or Stage.RUNNING
            self._stop_streamed(entry, "cancelled")
            return Stage.TRANSFER if streaming else stage
        if entry.state is HeldState.HELD:
            self._release(entry, "cancelled")
            return Stage.HELD
        if entry.state is HeldState.SENDING:  # stop the write; the blocks go when quiescent
            entry.transition(HeldState.CANCELLING)
            self.agent.abort(request_id)
        return Stage.TRANSFER

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_reap_interval_s)
            now = time.monotonic()
            for entry in self._held():
                if entry.state is HeldState.HELD and entry.lease.expired(now):
                    log.info(
                        "lease of %s expired; freeing %d blocks", entry.request_id, entry.num_blocks
                    )
                    self.metrics.lease_expiries.inc()
                    self._release(entry, "lease expired")
                elif (
                    entry.state is HeldState.SENDING
                    and now - entry.sent_at > self.config.sending_timeout_s
                ):
                    log.warning(
                        "write of %s unfinished after %.0fs; aborting it (blocks go once it "
                        "is quiescent)",
                        entry.request_id,
                        now - entry.sent_at,
                    )
                    self.metrics.sending_timeouts.inc()
                    entry.transition(HeldState.CANCELLING)
                    self.agent.abort(entry.request_id)

    def _release(self, entry: HeldKV, why: str) -> None:
        """RELEASED: the engine frees the blocks (no transfer can touch them any more)."""
        log.debug("releasing %s (%s)", entry.request_id, why)
        if entry.computing:  # streamed: stop the prompt first (commands apply in order)
            self.front.abort(entry.request_id)
        entry.transition(HeldState.RELEASED)
        self.front.release_held(entry.request_id)

    # -- KV-transfer events --------------------------------------------------------

    def on_transfer_event(self, event: TransferEvent) -> None:
        match event:
            case MessageReceived(peer_id, TransferRequest() as req):
                self._on_transfer_request(peer_id, req)
            case TransferDone(request_id):
                self._transfer_ended(request_id, ok=True)
            case TransferFailed(request_id, _, reason, detail):
                self.metrics.transfer_failures.labels(reason=reason.value).inc()
                log.info("transfer of %s failed: %s %s", request_id, reason.value, detail)
                self._transfer_ended(request_id, ok=False)
            case Quiescent(request_id):
                self._transfer_ended(request_id, ok=False)
            case _:
                pass  # peer up/down, Abort notices: the layer already ended the transfers

    def _on_transfer_request(self, peer_id: str, req: TransferRequest) -> None:
        entry = self._entry(req.request_id)
        if entry is None or not entry.admits(req.transfer_key):
            # A wrong key reads as an unknown id: a guesser learns nothing.
            if entry is not None:
                self.metrics.transfer_refusals.labels(reason="bad_key").inc()
                log.warning(
                    "TransferRequest for %s from %s without its key", req.request_id, peer_id
                )
            why = "unknown, expired or already sent"
            self.agent.send(peer_id, KVAborted(request_id=req.request_id, reason=why))
            return
        if entry.state not in (HeldState.HELD, HeldState.COMPUTING):
            self.agent.send(peer_id, KVAborted(request_id=req.request_id, reason="already sending"))
            return
        if req.skip_blocks + len(req.dst_block_ids) != entry.num_blocks or not req.dst_block_ids:
            why = (
                f"{req.skip_blocks} cached + {len(req.dst_block_ids)} destination blocks for "
                f"{entry.num_blocks} held"
            )
            self.agent.send(peer_id, KVAborted(request_id=req.request_id, reason=why))
            return
        if entry.state is HeldState.COMPUTING:  # streamed: write while the prompt computes
            self.streamer.start(entry, peer_id, req)
            return
        entry.transition(HeldState.SENDING)
        entry.peer_id = peer_id
        entry.sent_blocks = len(req.dst_block_ids)
        entry.sent_at = time.monotonic()
        if self.config.debug_transfer_delay_s:
            self.spawn(self._write_later(peer_id, req), f"write-{req.request_id}")
        else:
            self._write(peer_id, req)

    def _write(self, peer_id: str, req: TransferRequest) -> None:
        entry = self._entry(req.request_id)
        record = self.engine.record(req.request_id)
        if entry is None or record is None:
            return
        if entry.state is HeldState.CANCELLING:  # cancelled before the write was posted
            self._tell_aborted(peer_id, req.request_id, "cancelled")
            self._release(entry, "cancelled before the write")
            return
        try:
            if entry.stream is not None:  # streamed KV: the decode node has no first token
                self.agent.send(peer_id, first_token(entry))
            src = record.blocks[req.skip_blocks :]  # what the decode node does not have
            self.agent.write(req.request_id, peer_id, src, req.dst_block_ids)
        except TransferRejected as e:  # aborted (a cancel came first) or the peer is gone
            self._tell_aborted(peer_id, req.request_id, str(e))
            self._release(entry, f"write refused: {e}")

    def _tell_aborted(self, peer_id: str, request_id: str, reason: str) -> None:
        with contextlib.suppress(TransferRejected):  # the peer is gone: nothing to tell
            self.agent.send(peer_id, KVAborted(request_id=request_id, reason=reason))

    async def _write_later(self, peer_id: str, req: TransferRequest) -> None:
        """Fault injection: the transfer is committed (SENDING) but posted late."""
        await asyncio.sleep(self.config.debug_transfer_delay_s)
        self._write(peer_id, req)

    def _transfer_ended(self, request_id: str, ok: bool) -> None:
        entry = self._entry(request_id)
        if entry is None:
            return
        if entry.state is HeldState.STREAMING:
            log.info("streamed write of %s ended while its prompt computes", request_id)
        if ok:
            self.metrics.transfer_seconds.observe(time.monotonic() - entry.sent_at)
            self.metrics.transfer_bytes.observe(entry.sent_blocks * self.engine.block_bytes)
            self.metrics.kv_blocks_transferred.inc(entry.sent_blocks)
        self._release(entry, "transfer done" if ok else "transfer ended")
