"""The errors a node call raises: `NodeUnreachable` when the node did not (or may not have)
taken the request, and what a node's non-200 answer or a broken call means."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from proxy.http.backend import BackendError
from proxy.http.errors import INVALID_REQUEST, SERVER_ERROR

MOVED_CODES = frozenset({"stale_epoch", "wrong_role"})  # 409: the node did not take it
# POST /internal/role refusals, passed on as the node gave them (status and code)
ROLE_REFUSALS = frozenset({"fixed_role", "same_role", "role_change_in_progress"})


class NodeUnreachable(BackendError):
    """The node did not take the request; another node may. `maybe_received`: the connection
    broke after the request was written (a dead node, or a stale pooled connection), so the
    caller also sends the node a Cancel in case it lives."""

    def __init__(self, url: str, reason: str, maybe_received: bool = False) -> None:
        super().__init__(
            503,
            f"node {url} is unavailable: {reason}",
            type=SERVER_ERROR,
            code="unavailable",
            retry_after=1.0,
        )
        self.url = url
        self.maybe_received = maybe_received


class DecodeFull(Exception):
    """A decode node has no room for the request now (503 "decode_full")."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


def _error_fields(raw: bytes, status: int) -> tuple[str, str | None, str | None]:
    try:
        err = json.loads(raw)["error"]
        return str(err["message"]), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}", None, None


def status_error(url: str, status: int, retry_after: str | None, body: bytes) -> Exception:
    """The exception for a node's non-200 answer, from its OpenAI-style error body."""
    message, param, code = _error_fields(body, status)
    if status == 503 and code == "decode_full":
        return DecodeFull(url, message)
    if (status, code) == (503, "role_change_failed") or (status == 409 and code in ROLE_REFUSALS):
        error_type = SERVER_ERROR if status >= 500 else INVALID_REQUEST
        return BackendError(status, f"node {url}: {message}", type=error_type, code=code)
    if status in (429, 503) and code == "overloaded":
        retry = _retry_after(retry_after)
        return BackendError.overloaded(f"node {url} is overloaded: {message}", retry)
    if status == 503:
        return NodeUnreachable(url, message)
    if status == 409 and code in MOVED_CODES:
        return NodeUnreachable(url, f"{code}: {message}")
    if 400 <= status < 500:
        return BackendError.refused(message, param=param)
    return BackendError.failed(f"node {url} failed: {message}")


def _retry_after(value: str | None) -> float:
    try:
        return max(1.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


def transport_error(url: str, path: str, e: aiohttp.ClientError) -> BackendError:
    if isinstance(e, aiohttp.ClientConnectorError):  # nothing was sent
        return NodeUnreachable(url, describe(e))
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):  # no answer
        return NodeUnreachable(url, describe(e), maybe_received=True)
    return BackendError.failed(f"node {url} broke off {path}: {describe(e)}")


def describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
