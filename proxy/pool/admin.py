"""Run-time node management on the proxy.

    GET    /admin/nodes              {"fingerprint": ..., "nodes": [{url, role, healthy, ...}]}
    POST   /admin/nodes {"url", "role"?}   register (role checked against the node's /state;
                                           default: the role it reports) -> 201 {node}
    DELETE /admin/nodes?url=URL      stop routing to a node (in-flight requests finish) -> {node}
    POST   /admin/nodes/role {"url", "role", "drain_timeout_s"?}
                                     move a prefill or decode node to the other pool: it
                                     drains, bumps its epoch and serves in the new role
                                     (proxy/pool/roles.py) -> {node, previous_role, role,
                                     epoch, drained_s, evicted}
    POST   /admin/reset_prefix_cache every node forgets the cached blocks no request holds
                                     (vLLM's /reset_prefix_cache, SGLang's /flush_cache:
                                     benchmarks start each run cold) -> {blocks, nodes:
                                     [{url, blocks}]}; 502 naming the nodes that failed

Errors are OpenAI-style bodies: 400 bad body or role, 409 conflict (fingerprint or role
mismatch; a move of a `both` node, of the last node of a pool, or of a node being moved),
502 node unreachable, 404 unknown node.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.http.errors import INVALID_REQUEST, SERVER_ERROR, ApiError, invalid_request
from proxy.http.server import error_response, new_request_id
from proxy.pool.node_state import Node
from proxy.pool.registry import NodeRegistry, RegistrationError
from proxy.pool.roles import MoveRefused, RoleMover

MAX_ADMIN_BODY = 64 * 1024


class NodeRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    role: str | None = None


class RoleMoveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    role: str
    drain_timeout_s: float | None = Field(default=None, ge=0, le=3600)


class AdminRoutes:
    def __init__(self, registry: NodeRegistry, mover: RoleMover | None = None) -> None:
        self.registry = registry
        self.mover = mover  # None: this proxy moves no node (colocated)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/admin/nodes", self.list_nodes)
        app.router.add_post("/admin/nodes", self.register)
        app.router.add_delete("/admin/nodes", self.remove)
        app.router.add_post("/admin/nodes/role", self.move)
        app.router.add_post("/admin/reset_prefix_cache", self.reset_prefix_cache)

    async def list_nodes(self, request: web.Request) -> web.Response:
        nodes = [self._describe(n) for n in self.registry.nodes()]
        return web.json_response({"fingerprint": self.registry.fingerprint, "nodes": nodes})

    def _describe(self, node: Node) -> dict[str, Any]:
        """The node's row, with what the proxy knows of its prefix cache (KV events)."""
        row = node.describe()
        # Silent: no good poll for a while; it gets no new work while another node answers.
        row["silent"] = node.silent(time.monotonic(), self.registry.config.silence_s)
        index = self.registry.index
        cache = index.caches.get(node.url) if index is not None else None
        row["prefix_cache"] = None
        if cache is not None:
            synced = cache.next is not None
            row["prefix_cache"] = {"synced": synced, "blocks": len(cache.keys)}
        return row

    async def register(self, request: web.Request) -> web.Response:
        try:
            body = await request.content.read(MAX_ADMIN_BODY + 1)
            if len(body) > MAX_ADMIN_BODY:
                raise invalid_request("the body is too large")
            reg = NodeRegistration.model_validate_json(body)
            node = await self.registry.register(reg.url, reg.role)
        except ValidationError as e:
            return _error(invalid_request(f"expected {{'url', 'role'}}: {e.errors()[0]['msg']}"))
        except RegistrationError as e:
            return _error(_registration_error(e))
        except ApiError as e:
            return _error(e)
        return web.json_response(node.describe(), status=201)

    async def remove(self, request: web.Request) -> web.Response:
        url = request.query.get("url")
        if not url:
            return _error(invalid_request("give the node as ?url=URL", param="url"))
        try:
            node = self.registry.remove(url)
        except RegistrationError as e:
            return _error(_registration_error(e))
        if node is None:
            return _error(ApiError(404, f"no node {url} is registered", code="node_not_found"))
        return web.json_response(node.describe())

    async def move(self, request: web.Request) -> web.Response:
        if self.mover is None:
            return _error(ApiError(409, "this proxy's nodes have fixed roles", code="fixed_role"))
        try:
            body = await request.content.read(MAX_ADMIN_BODY + 1)
            if len(body) > MAX_ADMIN_BODY:
                raise invalid_request("the body is too large")
            req = RoleMoveRequest.model_validate_json(body)
            moved = await self.mover.move(
                req.url, req.role, "POST /admin/nodes/role", drain_timeout_s=req.drain_timeout_s
            )
        except ValidationError as e:
            return _error(invalid_request(f"expected {{'url', 'role'}}: {e.errors()[0]['msg']}"))
        except MoveRefused as e:
            error_type = SERVER_ERROR if e.status >= 500 else INVALID_REQUEST
            return _error(ApiError(e.status, e.message, type=error_type, param="url", code=e.code))
        except ApiError as e:
            return _error(e)
        result = moved.result
        return web.json_response(
            {
                "node": self._describe(moved.node),
                "previous_role": result.previous_role,
                "role": result.role,
                "epoch": result.epoch,
                "drained_s": round(result.drained_s, 3),
                "evicted": result.evicted,
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        nodes = self.registry.nodes()
        client = self.registry.client
        results = await asyncio.gather(
            *(client.reset_prefix_cache(n.url) for n in nodes), return_exceptions=True
        )
        rows, failed = [], []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, BaseException):
                failed.append(f"{node.url} ({result})")
            else:
                rows.append({"url": node.url, "blocks": result.blocks})
        if failed:
            message = "the prefix cache was not reset on " + ", ".join(failed)
            return _error(ApiError(502, message, type=SERVER_ERROR, code="node_unreachable"))
        return web.json_response({"blocks": sum(r["blocks"] for r in rows), "nodes": rows})


def _registration_error(e: RegistrationError) -> ApiError:
    code = {400: "invalid_node", 409: "node_conflict", 502: "node_unreachable"}.get(e.status)
    error_type = SERVER_ERROR if e.status >= 500 else INVALID_REQUEST
    return ApiError(e.status, e.message, type=error_type, param="url", code=code)


def _error(error: ApiError) -> web.Response:
    return error_response(error, new_request_id("admin"))
