"""The colocated node (`--role both`): prefill and decode in one engine.

The baseline disaggregation is compared against: the proxy streams a request
from POST /internal/generate, with no KV transfer.
"""

from __future__ import annotations

import time

from aiohttp import web

from common.engine.scheduler import StepOutput
from common.node.server import NodeServer, read_message, stream_outputs
from common.wire.node_messages import GenerateRequest, NodeEvent


class ColocatedNode(NodeServer):
    role = "both"

    def routes(self) -> list[web.RouteDef]:
        return [*super().routes(), web.post("/internal/generate", self.handle_generate)]

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        self.check_admitting()
        received = time.time()
        msg = await read_message(request, GenerateRequest)
        outputs = self.front.generate(msg.request_id, msg.prompt_token_ids, msg.sampling)
        self.metrics.requests.labels(outcome="admitted").inc()

        def first(out: StepOutput) -> list[NodeEvent]:
            events = self.engine_events(out, "prefill", "prefill admitted", "prefill done")
            return [("generate received", received), *events]

        return await stream_outputs(
            request, msg.request_id, outputs, None, first, self.metrics.token_gap.observe
        )
