"""`ColocatedBackend`: the token backend over `both` nodes, which prefill and decode each
request themselves. The router picks the node (cache hits against queued work); a node that
cannot be reached is tried no more for that request, up to `node_attempts` nodes; a stalled
stream ends the request with an error event (a colocated request is not migrated)."""

from __future__ import annotations

import functools
from contextlib import aclosing

from proxy.http.backend import GenerationRequest, NodeLost, TokenStream
from proxy.metrics import DisaggMetrics
from proxy.pool.client import NodeClient, NodeStream, NodeUnreachable
from proxy.pool.disagg import DisaggConfig
from proxy.pool.node_state import Node, Role
from proxy.pool.registry import NodeRegistry
from proxy.pool.relay import open_generate, relay, report_stall, report_unreachable
from proxy.trace import TraceStore


class ColocatedBackend:
    """`TokenBackend` over `both` nodes: the least busy one generates the whole request."""

    def __init__(
        self,
        registry: NodeRegistry,
        client: NodeClient,
        config: DisaggConfig | None = None,
        traces: TraceStore | None = None,
        metrics: DisaggMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.config = config or DisaggConfig()
        self.traces = traces or TraceStore(1)
        self.metrics = metrics

    async def generate(self, req: GenerationRequest) -> TokenStream:
        """The whole request on one node; a stall ends it with an error event (a colocated
        request is not migrated)."""
        stream, node, ticket = await self._open(req)
        computed = functools.partial(node.computed, ticket)  # at the first token
        try:
            chunks = relay(stream, req, self.client, traces=self.traces, on_first=computed)
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        except NodeLost as e:
            if e.cause == "stalled":
                report_stall(self.registry, self.traces, self.metrics, req.request_id, e, "both")
            raise

    async def _open(self, req: GenerationRequest) -> tuple[NodeStream, Node, int]:
        """The stream of the node the router picks, the node, and the send's ticket (its
        uncached prompt tokens count as queued there until the first token)."""
        tried: set[str] = set()
        while True:
            decision = self.registry.router.pick(Role.BOTH, req.prompt_token_ids, frozenset(tried))
            node = decision.node
            n = len(req.prompt_token_ids)
            ticket = node.sent(decision.chosen.uncached, kv_tokens=n)
            self.traces.record(req.request_id, "routed", detail=decision.detail())
            try:
                try:
                    return await open_generate(self.client, self.registry, node, req), node, ticket
                except BaseException:
                    node.computed(ticket)  # it will not compute this prompt
                    raise
            except NodeUnreachable as e:
                report_unreachable(self.registry, self.client, node, e, req.request_id)
                tried.add(node.url)
                if len(tried) >= self.config.node_attempts:
                    raise
