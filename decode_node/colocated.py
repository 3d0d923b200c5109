"""The colocated node (`--role both`): prefill and decode in one engine.

The baseline disaggregation is compared against: the proxy streams a request
from POST /internal/generate (`NodeServer.handle_generate`), with no KV transfer.
"""

from __future__ import annotations

from aiohttp import web

from common.node.server import NodeServer


class ColocatedNode(NodeServer):
    role = "both"

    def routes(self) -> list[web.RouteDef]:
        return [*super().routes(), web.post("/internal/generate", self.handle_generate)]
