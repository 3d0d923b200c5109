"""The part of a node that owns a KV-transfer agent (prefill and decode roles).

The agent's progress thread moves bytes; its events come back to the event
loop through one pump task, which hands each to the role's `on_transfer_event`.
On stop the pump is cancelled first (NodeServer.stop), then the agent is closed:
every unfinished transfer ends quiescent inside close(), its terminal event is
handled, and the role frees what is left.
"""

from __future__ import annotations

import asyncio
import logging

from common.node.server import NodeConfig, NodeRuntime, NodeServer
from kv_transfer import KVTransferAgent, TransferEvent

log = logging.getLogger(__name__)


async def start_agent(config: NodeConfig, runtime: NodeRuntime) -> KVTransferAgent:
    """The node's KV-transfer agent over the runtime's cache (registered once, here)."""
    return await asyncio.to_thread(
        KVTransferAgent,
        config.transfer,
        runtime.engine.kv_cache,
        runtime.engine_id,
        runtime.fingerprint,
    )


class TransferNode(NodeServer):
    def __init__(self, config: NodeConfig, runtime: NodeRuntime, agent: KVTransferAgent) -> None:
        super().__init__(config, runtime)
        self.agent = agent

    def start_role(self) -> None:
        self.spawn(self._pump_events(), "kv-events")
        self.spawn(self._watch_agent(), "kv-watch")

    async def _watch_agent(self, interval_s: float = 0.5) -> None:
        """A dead progress thread moves no byte and frees nothing: fail the node."""
        while (error := self.agent.failure()) is None:
            await asyncio.sleep(interval_s)
        self.fail(f"the KV-transfer progress thread died: {error!r}")

    async def stop_role(self) -> None:
        await asyncio.to_thread(self.agent.close)
        for event in self.agent.poll_events():
            self.on_transfer_event(event)
        self.release_all()

    def state(self) -> dict[str, object]:
        return {
            **super().state(),
            "kv_transfer": {
                "backend": self.config.transfer.backend,
                "side_channel": self.agent.address,
                "peers": len(self.agent.peers()),
                "rejected_messages": self.agent.rejected_messages,
                "step_errors": self.agent.step_errors,
                "quarantined": self.agent.quarantined,
                "quarantine_timeouts": self.agent.quarantine_timeouts,
            },
        }

    def on_transfer_event(self, event: TransferEvent) -> None:
        raise NotImplementedError

    def release_all(self) -> None:
        """Free every block the role still holds; transfers are quiescent by now."""
        raise NotImplementedError

    async def _pump_events(self) -> None:
        while True:
            for event in await self.agent.next_events():
                try:
                    self.on_transfer_event(event)
                except Exception:
                    log.exception("handling %r", event)
