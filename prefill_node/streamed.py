"""Streamed KV: a prefill node writes each group of prompt blocks as the engine completes it.

The engine pins every full prompt block the step it is computed (KV_COMPUTED outputs), so a
write may read it whatever happens to the request afterwards. Once a decode node asked for
the KV (its TransferRequest), the node opens one streamed write (`KVTransferAgent.write(...,
final=False)`) with the groups computed so far, adds each later group (`write_more`) and, when
the first token is sampled, sends it (`KVFirstToken`) and the last group, the rest of the
held blocks, as the final segment. The transfer then ends as any other: one terminal event,
after which the node releases the blocks (`server.py`).

    prompt blocks  [ skipped (decode has them) | group 1 | group 2 | ... | last group ]
                                               ^ written while later chunks compute ^ after
                                                                                  the first token

Everything here runs on the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from common.node.metrics import NodeMetrics
from common.wire.messages import KVFirstToken, TransferRequest
from kv_transfer import KVTransferAgent, TransferRejected
from prefill_node.held import HeldKV, HeldState

log = logging.getLogger(__name__)


class KVStreamer:
    """Writes streamed prefills' KV. `refused(entry, why)` ends an entry whose write could
    not be opened (nothing was posted: the node tells the peer and releases the blocks)."""

    def __init__(
        self,
        agent: KVTransferAgent,
        metrics: NodeMetrics,
        refused: Callable[[HeldKV, str], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], object],
        last_delay_s: float = 0.0,
    ) -> None:
        """`spawn(coro, name)` starts a task the node owns; `last_delay_s` (fault injection,
        --debug-transfer-delay) posts each last group that late, so that a test can catch
        a request after its last group was committed."""
        self.agent = agent
        self.metrics = metrics
        self.refused = refused
        self.spawn = spawn
        self.last_delay_s = last_delay_s

    def start(self, entry: HeldKV, peer_id: str, req: TransferRequest) -> None:
        """COMPUTING -> STREAMING: the destination is known; write what is computed."""
        assert entry.stream is not None
        entry.transition(HeldState.STREAMING)
        entry.peer_id = peer_id
        entry.sent_blocks = len(req.dst_block_ids)
        entry.stream.dst_block_ids = list(req.dst_block_ids)
        entry.stream.skip_blocks = entry.stream.sent = req.skip_blocks
        self._write(entry, entry.stream.computed, final=False)

    def computed(self, entry: HeldKV, blocks: list[int]) -> None:
        """The engine completed (and pinned) `blocks`, the next prompt positions."""
        assert entry.stream is not None
        entry.stream.computed += blocks
        if entry.state is HeldState.STREAMING:
            self._write(entry, entry.stream.computed, final=False)

    def last(self, entry: HeldKV, held_blocks: list[int]) -> None:
        """STREAMING -> SENDING: the first token is sampled; send it and the rest."""
        assert entry.stream is not None and entry.peer_id is not None
        try:
            self.agent.send(entry.peer_id, first_token(entry))
        except TransferRejected as e:  # the peer is gone: the transfer fails as well
            log.info("first token of %s not sent: %s", entry.request_id, e)
        entry.transition(HeldState.SENDING)
        entry.sent_at = time.monotonic()
        if self.last_delay_s:
            self.spawn(self._last_later(entry, held_blocks), f"write-{entry.request_id}")
        else:
            self._write(entry, held_blocks, final=True)

    async def _last_later(self, entry: HeldKV, held_blocks: list[int]) -> None:
        await asyncio.sleep(self.last_delay_s)
        assert entry.stream is not None
        if entry.state is HeldState.SENDING:
            self._write(entry, held_blocks, final=True)
        elif entry.state is HeldState.CANCELLING and not entry.stream.opened:
            self.refused(entry, "cancelled before the write")  # (opened: its abort ends it)

    def _write(self, entry: HeldKV, blocks: list[int], final: bool) -> None:
        st = entry.stream
        assert st is not None and entry.peer_id is not None
        src, dst = st.next_group(blocks)
        if not src:
            assert not final, (entry.request_id, st)  # the last block is never skipped
            return
        try:
            if st.opened:
                self.agent.write_more(entry.request_id, entry.peer_id, src, dst, final)
            else:
                self.agent.write(entry.request_id, entry.peer_id, src, dst, final)
                st.opened = True
        except TransferRejected as e:
            if st.opened:  # the write has ended: its terminal event releases the blocks
                log.info("group of %s not written: %s", entry.request_id, e)
            else:
                self.refused(entry, f"write refused: {e}")
            return
        st.sent += len(src)
        st.groups += 1
        self.metrics.kv_groups.inc()
        log.debug(
            "%s: kv group %d (%d blocks%s) written", entry.request_id, st.groups, len(src),
            ", the last" if final else "",
        )  # fmt: skip


def first_token(entry: HeldKV) -> KVFirstToken:
    """The message that gives a streamed prefill's first token to its decode node."""
    assert entry.stream is not None and entry.stream.first_token is not None, entry.request_id
    return KVFirstToken(
        request_id=entry.request_id,
        token_id=entry.stream.first_token,
        sampled_at=entry.stream.sampled_at,
    )
