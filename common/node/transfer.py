"""The part of a node that owns a KV-transfer agent (prefill and decode roles).

The agent's progress thread moves bytes; its events come back to the event
loop through one pump task, which hands each to the role's `on_transfer_event`.
On stop the pump is cancelled first (Node.stop), then the agent is closed:
every unfinished transfer ends quiescent inside close(), its terminal event is
handled, and the role frees what is left.
"""

from __future__ import annotations

import asyncio
import logging

from common.node.server import Node
from kv_transfer import KVTransferAgent, TransferEvent

log = logging.getLogger(__name__)


class TransferNode(Node):
    agent: KVTransferAgent | None = None

    async def start_role(self) -> None:
        assert self.engine is not None and self.fingerprint is not None
        self.agent = await asyncio.to_thread(
            KVTransferAgent,
            self.config.transfer,
            self.engine.kv_cache,
            self.engine_id,
            self.fingerprint,
        )
        self.spawn(self._pump_events(), "kv-events")

    async def stop_role(self) -> None:
        if self.agent is not None:
            await asyncio.to_thread(self.agent.close)
            for event in self.agent.poll_events():
                self.on_transfer_event(event)
        self.release_all()

    def on_transfer_event(self, event: TransferEvent) -> None:
        raise NotImplementedError

    def release_all(self) -> None:
        """Free every block the role still holds; transfers are quiescent by now."""
        raise NotImplementedError

    async def _pump_events(self) -> None:
        assert self.agent is not None
        while True:
            for event in await self.agent.next_events():
                try:
                    self.on_transfer_event(event)
                except Exception:
                    log.exception("handling %r", event)
