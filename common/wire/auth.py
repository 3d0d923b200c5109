"""Bearer tokens on pdserve's HTTP surfaces.

Two secrets, both optional and both sent as ``Authorization: Bearer <secret>``:

    cluster token   shared by the proxy and its nodes (``--cluster-token-file PATH`` or
                    $PDSERVE_CLUSTER_TOKEN); guards the internal endpoints of nodes and proxy
                    (``/internal/*``, ``/state``, ``/admin/*``, ``/debug/*``). ``/health`` and
                    ``/metrics`` stay open, for load balancers and scrapers.
    API key         the OpenAI front's (``--api-key`` or $PDSERVE_API_KEY), as `vllm serve`
                    takes one; guards ``/v1/*`` on the proxy.

Comparisons are constant-time. A refusal is a 401 with an OpenAI-style body and a
``WWW-Authenticate: Bearer`` header.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from common.wire.errors import ApiError, error_response

CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
API_KEY_ENV = "PDSERVE_API_KEY"
MIN_SECRET_LEN = 16
INTERNAL_PREFIXES = ("/internal/", "/admin/", "/debug/")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Unauthorized(ApiError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(401, message, code=code)

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "WWW-Authenticate": "Bearer"}


def read_secret(path: str | None, env: str) -> str | None:
    """The secret in file `path` (surrounding whitespace dropped), else in $`env`, else None.
    ValueError for an unreadable, empty or short secret (under MIN_SECRET_LEN characters)."""
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read the secret file {path}: {e.strerror}") from None
        where = path
    else:
        value = os.environ.get(env, "").strip()
        where = f"${env}"
        if not value:
            return None
    if len(value) < MIN_SECRET_LEN:
        raise ValueError(f"the secret in {where} is shorter than {MIN_SECRET_LEN} characters")
    return value


def bearer(secret: str) -> dict[str, str]:
    """The request header carrying `secret`."""
    return {"Authorization": f"Bearer {secret}"}


def carries(request: web.Request, secret: str) -> bool:
    """Whether `request` carries `secret` as its bearer token (constant-time comparison)."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), secret.encode())


def is_internal(path: str) -> bool:
    return path == "/state" or path.startswith(INTERNAL_PREFIXES)


def is_loopback(host: str) -> bool:
    """True for a loopback address or `localhost`; False for anything else (0.0.0.0 too)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_middleware(cluster_token: str | None, api_key: str | None = None) -> Middleware:
    """Refuses internal paths without `cluster_token` and ``/v1/*`` without `api_key` (each
    check only when its secret is set)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if cluster_token is not None and is_internal(path) and not carries(request, cluster_token):
            return error_response(
                Unauthorized("this endpoint needs the cluster token", "invalid_cluster_token")
            )
        if api_key is not None and path.startswith("/v1/") and not carries(request, api_key):
            return error_response(
                Unauthorized(
                    "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                    "invalid_api_key",
                )
            )
        return await handler(request)

    return check
