"""HTTP client of the nodes' internal API (`common.wire.node_messages`): one aiohttp session, a
timeout per call kind, NDJSON token streams, and error bodies turned into `BackendError`s.

Error mapping (what a caller may do next):
- `NodeUnreachable` (503): the node never took the request (connection refused or reset
  before an answer, or it answered 503 while draining); trying another node is safe.
- `DecodeFull`: a decode node answered 503 "decode_full"; the request stays queued.
- `BackendError` 400 (a node refused the request), 503 overloaded (its queue is full),
  502 (timed out, died mid-call, sent garbage): the node may hold state for the request,
  so the caller cancels it there.

`cancel_soon` sends a `Cancel` from a task this client owns (never awaited by the caller);
`close()` gives pending cancels a short grace before closing the session.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from common.wire.auth import bearer
from common.wire.messages import Cancel, Message, MessageError
from common.wire.node_messages import (
    CancelResult,
    LeaseExtend,
    LeaseExtendResult,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    from_json,
    to_json,
)
from proxy.http.backend import BackendError, NodeLost, TokenChunk
from proxy.http.errors import SERVER_ERROR

log = logging.getLogger(__name__)

PREFILL_PATH = "/internal/prefill"
EXTEND_PATH = "/internal/extend"
DECODE_PATH = "/internal/decode"
GENERATE_PATH = "/internal/generate"
CANCEL_PATH = "/internal/cancel"
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_ERROR_BODY = 64 * 1024
KV_ERROR_CODES = frozenset({"kv_failed", "kv_timeout", "kv_handshake"})
R = TypeVar("R", bound=Message)


@dataclass(frozen=True)
class NodeTimeouts:
    """Seconds allowed per call kind."""

    connect_s: float = 3.0
    control_s: float = 5.0  # /health, /state, extend, cancel
    prefill_s: float = 120.0  # a whole prefill call: the node's queue plus compute
    first_byte_s: float = 60.0  # a token stream's headers (decode: reservation, maybe KV wait)
    read_line_s: float = 60.0  # between two lines of a token stream (the KV transfer included)
    cancel_grace_s: float = 2.0  # close(): how long pending cancels may still run

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"NodeTimeouts.{name} must be positive, got {value}")


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


class NodeStream:
    """An accepted token stream (decode or generate) of one request; one consumer owns it.

    `close()` drops the connection at once, without network I/O: the node takes the
    disconnect as a cancel. Idempotent.
    """

    def __init__(
        self, url: str, request_id: str, resp: aiohttp.ClientResponse, read_timeout_s: float
    ) -> None:
        self.url = url
        self.request_id = request_id
        self._resp = resp
        self._read_timeout_s = read_timeout_s
        self.events: list[tuple[str, float]] = []  # trace events the node sent, until taken

    async def next_chunk(self) -> TokenChunk:
        """The next chunk; the last one carries `finish_reason`. BackendError (502) on an error
        line, garbage, a timeout, or the stream ending without a finish."""
        while True:
            line = await self._readline()
            if not line:
                raise NodeLost(
                    self.url, f"node {self.url} ended the stream without finishing", True
                )
            if line.strip():
                return self._chunk(line)

    def close(self) -> None:
        self._resp.close()

    async def _readline(self) -> bytes:
        try:
            return await asyncio.wait_for(self._resp.content.readline(), self._read_timeout_s)
        except asyncio.TimeoutError:
            raise NodeLost(
                self.url, f"node {self.url} sent nothing for {self._read_timeout_s:g} s", True
            ) from None
        except aiohttp.ClientError as e:
            raise NodeLost(self.url, f"node {self.url} stream broke: {e!r}", True) from None
        except ValueError as e:  # an over-long line
            raise BackendError.failed(f"node {self.url} sent a bad stream: {e!r}") from None

    def _chunk(self, line: bytes) -> TokenChunk:
        try:
            delta = from_json(line, TokenDelta)
        except MessageError as e:
            raise BackendError.failed(f"node {self.url} sent a bad stream line: {e}") from None
        if delta.request_id != self.request_id:
            raise BackendError.failed(f"node {self.url} streamed tokens of another request")
        self.events += delta.events
        if delta.error is not None:
            message = f"node {self.url} failed the request: {delta.error}"
            if delta.error_code in KV_ERROR_CODES:  # the KV never came: re-prefill may help
                raise NodeLost(self.url, message, node_down=False)
            raise BackendError.failed(message)
        return TokenChunk(list(delta.token_ids), delta.finish_reason, delta.num_cached_tokens)


class NodeClient:
    """Calls into nodes. `start()` inside the event loop before use, `close()` after."""

    def __init__(
        self,
        timeouts: NodeTimeouts | None = None,
        on_cancel: Callable[[str, CancelResult], None] | None = None,
        cluster_token: str | None = None,
    ) -> None:
        self.timeouts = timeouts or NodeTimeouts()
        self.on_cancel = on_cancel  # told each node's answer to a cancel (for the trace)
        self._headers = bearer(cluster_token) if cluster_token is not None else {}
        self._session: aiohttp.ClientSession | None = None
        self._cancels: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=self._headers
        )

    async def close(self) -> None:
        if self._cancels:
            await asyncio.wait(set(self._cancels), timeout=self.timeouts.cancel_grace_s)
        for task in list(self._cancels):
            task.cancel()
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("NodeClient.start() was not called")
        return self._session

    # -- control calls -----------------------------------------------------------------------

    async def health(self, url: str) -> bool:
        """True on 200, False on 503 (draining, engine dead); NodeUnreachable otherwise."""
        try:
            async with self.session.get(url + "/health", timeout=self._control()) as resp:
                await resp.read()
                if resp.status in (200, 503):
                    return resp.status == 200
                raise NodeUnreachable(url, f"GET /health answered {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise NodeUnreachable(url, _describe(e)) from None

    async def state(self, url: str) -> dict[str, Any]:
        return await self._get_json(url, "/state")

    async def kv_cache(self, url: str) -> dict[str, Any]:
        """The node's KV-event snapshot (GET /internal/kv_cache)."""
        return await self._get_json(url, "/internal/kv_cache")

    async def _get_json(self, url: str, path: str) -> dict[str, Any]:
        try:
            async with self.session.get(url + path, timeout=self._control()) as resp:
                if resp.status != 200:
                    raise NodeUnreachable(url, f"GET {path} answered {resp.status}")
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise NodeUnreachable(url, _describe(e)) from None
        if not isinstance(data, dict):
            raise NodeUnreachable(url, f"GET {path} did not answer a JSON object")
        return data

    async def prefill(self, url: str, req: PrefillRequest) -> PrefillResult:
        return await self._call(
            url, PREFILL_PATH, req, PrefillResult, self._total(self.timeouts.prefill_s)
        )

    async def extend(self, url: str, req: LeaseExtend) -> LeaseExtendResult:
        return await self._call(url, EXTEND_PATH, req, LeaseExtendResult, self._control())

    async def cancel(self, url: str, request_id: str) -> CancelResult:
        msg = Cancel(request_id=request_id)
        return await self._call(url, CANCEL_PATH, msg, CancelResult, self._control())

    def cancel_soon(self, url: str, request_id: str) -> None:
        """Send a Cancel from a task this client owns; failures are logged, not raised."""
        task = asyncio.get_running_loop().create_task(self._cancel_quietly(url, request_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    # -- token streams -----------------------------------------------------------------------

    async def open_stream(self, url: str, path: str, msg: Message, request_id: str) -> NodeStream:
        """POST `msg` and return the accepted NDJSON stream (after the 200 headers)."""
        try:
            resp = await asyncio.wait_for(self._post(url + path, msg), self.timeouts.first_byte_s)
        except aiohttp.ConnectionTimeoutError:  # (a TimeoutError too): never reached the node
            raise self._no_connection(url) from None
        except asyncio.TimeoutError:
            raise BackendError.failed(
                f"node {url} did not answer {path} within {self.timeouts.first_byte_s:g} s"
            ) from None
        except aiohttp.ClientError as e:
            raise _transport_error(url, path, e) from None
        if resp.status != 200:
            try:
                raise await self._error(url, resp)
            finally:
                resp.close()
        return NodeStream(url, request_id, resp, self.timeouts.read_line_s)

    # -- internals ---------------------------------------------------------------------------

    def _no_connection(self, url: str) -> NodeUnreachable:
        """No connection within the connect timeout (a partition, a node gone silent): the
        request was never sent, so another node may take it."""
        return NodeUnreachable(url, f"no connection within {self.timeouts.connect_s:g} s")

    def _control(self) -> aiohttp.ClientTimeout:
        return self._total(self.timeouts.control_s)

    def _total(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self.timeouts.connect_s)

    async def _post(self, url: str, msg: Message) -> aiohttp.ClientResponse:
        return await self.session.post(url, data=to_json(msg), headers=JSON_HEADERS)

    async def _call(
        self, url: str, path: str, msg: Message, result: type[R], timeout: aiohttp.ClientTimeout
    ) -> R:
        try:
            async with self.session.post(
                url + path, data=to_json(msg), headers=JSON_HEADERS, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    raise await self._error(url, resp)
                body = await resp.read()
        except aiohttp.ConnectionTimeoutError:  # (a TimeoutError too): never reached the node
            raise self._no_connection(url) from None
        except asyncio.TimeoutError:
            raise BackendError.failed(
                f"node {url} did not answer {path} within {timeout.total:g} s"
            ) from None
        except aiohttp.ClientError as e:
            raise _transport_error(url, path, e) from None
        try:
            return from_json(body, result)
        except MessageError as e:
            raise BackendError.failed(f"node {url} answered {path} with garbage: {e}") from None

    async def _error(self, url: str, resp: aiohttp.ClientResponse) -> Exception:
        """The exception for a non-200 answer, from its OpenAI-style error body."""
        try:
            raw = await asyncio.wait_for(resp.content.read(MAX_ERROR_BODY), self.timeouts.control_s)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            raw = b""
        message, param, code = _error_fields(raw, resp.status)
        return _status_error(url, resp, message, param, code)

    async def _cancel_quietly(self, url: str, request_id: str) -> None:
        try:
            result = await self.cancel(url, request_id)
            log.debug("cancel %s on %s: stage=%s", request_id, url, result.stage)
            if self.on_cancel is not None:
                self.on_cancel(url, result)
        except BackendError as e:
            log.info("cancel %s on %s failed: %s", request_id, url, e.message)


def _error_fields(raw: bytes, status: int) -> tuple[str, str | None, str | None]:
    try:
        err = json.loads(raw)["error"]
        return str(err["message"]), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}", None, None


def _status_error(
    url: str, resp: aiohttp.ClientResponse, message: str, param: str | None, code: str | None
) -> Exception:
    status = resp.status
    if status == 503 and code == "decode_full":
        return DecodeFull(url, message)
    if status in (429, 503) and code == "overloaded":
        retry = _retry_after(resp.headers.get("Retry-After"))
        return BackendError.overloaded(f"node {url} is overloaded: {message}", retry)
    if status == 503:
        return NodeUnreachable(url, message)
    if 400 <= status < 500:
        return BackendError.refused(message, param=param)
    return BackendError.failed(f"node {url} failed: {message}")


def _retry_after(value: str | None) -> float:
    try:
        return max(1.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


def _transport_error(url: str, path: str, e: aiohttp.ClientError) -> BackendError:
    if isinstance(e, aiohttp.ClientConnectorError):  # nothing was sent
        return NodeUnreachable(url, _describe(e))
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):  # no answer
        return NodeUnreachable(url, _describe(e), maybe_received=True)
    return BackendError.failed(f"node {url} broke off {path}: {_describe(e)}")


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
