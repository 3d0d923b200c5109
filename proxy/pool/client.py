"""HTTP client of the nodes' internal API (`common.wire.node_messages`): one aiohttp session
for control calls, `http1`'s lean client for the calls on every first token's path (the
prefill, streamed or in one call, and the decode and generate streams), a timeout per
call kind, NDJSON token streams, and error bodies turned into `BackendError`s
(`node_errors`).

Error mapping (what a caller may do next):
- `NodeUnreachable` (503): the node never took the request (connection refused or reset
  before an answer, it answered 503 while draining, or 409 "stale_epoch" / "wrong_role":
  it changed role since this proxy last saw it); trying another node is safe.
- `DecodeFull`: a decode node answered 503 "decode_full"; the request stays queued.
- `BackendError` 400 (a node refused the request), 503 overloaded (its queue is full),
  502 (timed out, died mid-call, sent garbage): the node may hold state for the request,
  so the caller cancels it there.

`cancel_soon` sends a `Cancel` from a task this client owns (never awaited by the caller),
and sends it again with backoff while the node does not answer (a hung node gets it when it
answers again, within `cancel_retry_s`); `close()` gives pending cancels a short grace
before closing the session.

A hung node breaks no connection, so two things end the waits on it:
- a token stream silent for `stall_s` after its first line is `NodeLost` "stalled" (the
  first line may wait on a prefill queue or a KV transfer; a silent node shows up as
  unreachable then);
- `abort(url, reason)` (the registry found the node unreachable) ends at once, as `NodeLost`
  "node_down", every open stream from that node and every decode stream still waiting for
  the KV that node was sending, and as `NodeUnreachable` every prefill call or stream
  opening in flight to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from common.wire.auth import bearer
from common.wire.messages import Cancel, Message, MessageError
from common.wire.node_messages import (
    CancelResult,
    KVPeers,
    KVPeersResult,
    LeaseExtend,
    LeaseExtendResult,
    PrefillRequest,
    PrefillResult,
    ResetPrefixCache,
    ResetPrefixCacheResult,
    RoleChange,
    RoleChangeResult,
    from_json,
    to_json,
)
from proxy.http.backend import BackendError, NodeLost
from proxy.pool import http1
from proxy.pool.node_errors import DecodeFull as DecodeFull  # (re-exported)
from proxy.pool.node_errors import NodeUnreachable as NodeUnreachable  # (re-exported)
from proxy.pool.node_errors import describe, status_error, transport_error
from proxy.pool.node_stream import NodeStream as NodeStream  # (re-exported)
from proxy.pool.prefill_stream import PrefillStream

log = logging.getLogger(__name__)

PREFILL_PATH = "/internal/prefill"
PREFILL_STREAMED_PATH = "/internal/prefill_streamed"
EXTEND_PATH = "/internal/extend"
DECODE_PATH = "/internal/decode"
GENERATE_PATH = "/internal/generate"
CANCEL_PATH = "/internal/cancel"
ROLE_PATH = "/internal/role"
RESET_PREFIX_CACHE_PATH = "/internal/reset_prefix_cache"
KV_PEERS_PATH = "/internal/kv_peers"
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_ERROR_BODY = 64 * 1024
R = TypeVar("R", bound=Message)
T = TypeVar("T")


@dataclass(frozen=True)
class NodeTimeouts:
    """Seconds allowed per call kind."""

    connect_s: float = 3.0
    control_s: float = 5.0  # /health, /state, extend, cancel
    prefill_s: float = 120.0  # a whole prefill call: the node's queue plus compute
    first_byte_s: float = 60.0  # a token stream's headers (decode: reservation, maybe KV wait)
    read_line_s: float = 60.0  # between two lines of a token stream (the KV transfer included)
    stall_s: float = 5.0  # between two lines after the first: longer is a stall (0: off)
    cancel_grace_s: float = 2.0  # close(): how long pending cancels may still run
    cancel_retry_s: float = 300.0  # a Cancel is sent again while the node does not answer

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0 and name != "stall_s":
                raise ValueError(f"NodeTimeouts.{name} must be positive, got {value}")
        if self.stall_s < 0:
            raise ValueError(f"NodeTimeouts.stall_s must be >= 0, got {self.stall_s}")


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
        self._session: aiohttp.ClientSession | None = None  # control calls
        self._http: http1.Http1Client | None = None  # the first token's calls (see `_open`)
        self._cancels: set[asyncio.Task[None]] = set()
        self._streams: set[NodeStream] = set()  # open token streams (for abort)
        self._calls: dict[str, set[_Guard]] = {}  # guarded calls in flight, by node
        self._heard: dict[str, float] = {}  # each node's last answer (loop time)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            headers=self._headers,
            # Nodes set no cookies and compress nothing: skip the per-request cookie
            # filtering and the decompression check.
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )
        self._http = http1.Http1Client(self.timeouts.connect_s, self._headers)

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
        if self._http is not None:
            await self._http.close()
            self._http = None

    @property
    def connections_opened(self) -> int:
        """Connections made for the first token's calls (prefill, decode and generate
        streams); each call takes an idle one to its node when there is one."""
        return self._http.opened if self._http is not None else 0

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
            raise NodeUnreachable(url, describe(e)) from None

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
            raise NodeUnreachable(url, describe(e)) from None
        if not isinstance(data, dict):
            raise NodeUnreachable(url, f"GET {path} did not answer a JSON object")
        return data

    async def prefill(self, url: str, req: PrefillRequest) -> PrefillResult:
        """The one-call prefill (its answer is the first token), over `http1` as the
        streamed calls are: it is on the first token's path too."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.prefill_s
        resp = await self._open(url, PREFILL_PATH, req, self.timeouts.prefill_s)
        try:
            async with asyncio.timeout_at(deadline):
                body = await self._guarded(url, resp.read())
        except asyncio.TimeoutError:
            raise BackendError.failed(
                f"node {url} did not answer {PREFILL_PATH} within {self.timeouts.prefill_s:g} s"
            ) from None
        except http1.HttpError as e:  # it answered 200, then its connection broke
            raise NodeUnreachable(url, f"broke off: {e}", maybe_received=True) from None
        finally:
            resp.close()
        try:
            return from_json(body, PrefillResult)
        except MessageError as e:
            raise BackendError.failed(
                f"node {url} answered {PREFILL_PATH} with garbage: {e}"
            ) from None

    async def prefill_streamed(self, url: str, req: PrefillRequest) -> PrefillStream:
        """Start a streamed prefill (KV written while the prompt computes); the stream's
        first line, the KV handle, is `accepted()`, its second the result. Errors as for
        `prefill` until the node answered 200."""
        resp = await self._open(url, PREFILL_STREAMED_PATH, req, self.timeouts.prefill_s)
        return PrefillStream(url, req.request_id, resp, self.timeouts.prefill_s, self._guarded)

    async def extend(self, url: str, req: LeaseExtend) -> LeaseExtendResult:
        return await self._call(url, EXTEND_PATH, req, LeaseExtendResult, self._control())

    async def cancel(self, url: str, request_id: str, choice: int | None = None) -> CancelResult:
        msg = Cancel(request_id=request_id, choice=choice)
        return await self._call(url, CANCEL_PATH, msg, CancelResult, self._control())

    async def change_role(self, url: str, msg: RoleChange, timeout_s: float) -> RoleChangeResult:
        """Have the node drain and change role (it answers when done, or with an error)."""
        return await self._call(url, ROLE_PATH, msg, RoleChangeResult, self._total(timeout_s))

    async def kv_peers(self, url: str, side_channels: list[str]) -> KVPeersResult:
        """Have a decode node connect now to these prefill nodes' KV side channels."""
        msg = KVPeers(side_channels=side_channels)
        return await self._call(url, KV_PEERS_PATH, msg, KVPeersResult, self._control())

    async def reset_prefix_cache(self, url: str) -> ResetPrefixCacheResult:
        """Have the node forget the cached blocks no request holds."""
        return await self._call(
            url, RESET_PREFIX_CACHE_PATH, ResetPrefixCache(), ResetPrefixCacheResult,
            self._control(),
        )  # fmt: skip

    def cancel_soon(self, url: str, request_id: str, choice: int | None = None) -> None:
        """Send a Cancel (of one `choice` only, if given) from a task this client owns, again
        with backoff while the node does not answer (up to `cancel_retry_s`); failures are
        logged, not raised."""
        cancel = self._cancel_quietly(url, request_id, choice)
        task = asyncio.get_running_loop().create_task(cancel)
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    def abort(self, url: str, reason: str) -> int:
        """The node at `url` is unreachable: end what waits on it (see the module doc).
        Returns how many streams and calls were ended."""
        lost = [s for s in self._streams if s.url == url or s.kv_from == url]
        for stream in lost:
            what = "" if stream.url == url else f" (its KV was coming from {url})"
            stream.abort(NodeLost(url, f"node {url} is down{what}: {reason}", True, "node_down"))
        calls = self._calls.pop(url, set())
        for guard in calls:
            guard.trip(NodeUnreachable(url, f"down: {reason}", maybe_received=True))
        return len(lost) + len(calls)

    def heard_since(self, url: str, t: float) -> bool:
        """Whether the node at `url` answered anything at or after loop time `t`: a call's
        answer, a stream's headers or a line of one. A poll that timed out although the node
        answered since it began proves the poll's connection stuck, not the node gone (after
        a partition heals, a connection in TCP's retransmission backoff stays silent for
        seconds while new ones work)."""
        if self._heard.get(url, float("-inf")) >= t:
            return True
        return any(s.url == url and s.heard >= t for s in self._streams)

    async def _open(self, url: str, path: str, msg: Message, timeout_s: float) -> http1.Response:
        """POST `msg` for an NDJSON answer: the response once the node answered 200 within
        `timeout_s`; else the error its answer (or its absence) means.

        On `http1`, not aiohttp: these are the calls on every first token's path (the
        prefill, the decode stream), and aiohttp's client costs 0.2 ms more each."""
        if self._http is None:
            raise RuntimeError("NodeClient.start() was not called")
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: no task (see PrefillStream)
                resp = await self._guarded(url, self._http.post(url, path, to_json(msg)))
        except http1.ConnectTimedOut:  # never reached the node
            raise self._no_connection(url) from None
        except asyncio.TimeoutError:
            raise BackendError.failed(
                f"node {url} did not answer {path} within {timeout_s:g} s"
            ) from None
        except http1.ConnectFailed as e:  # nothing was sent
            raise NodeUnreachable(url, str(e)) from None
        except http1.ConnectionBroken as e:  # no answer: it may have taken the request
            raise NodeUnreachable(url, str(e), maybe_received=True) from None
        except http1.HttpError as e:
            raise BackendError.failed(f"node {url} broke off {path}: {e}") from None
        self._answered(url)
        if resp.status != 200:
            try:
                raise await self._error(url, resp)
            finally:
                resp.close()
        return resp

    # -- token streams -----------------------------------------------------------------------

    async def open_stream(
        self,
        url: str,
        path: str,
        msg: Message,
        request_id: str,
        stall_s: float | None = None,
        kv_from: str | None = None,
    ) -> NodeStream:
        """POST `msg` and return the accepted NDJSON stream (after the 200 headers). The
        stream is stalled after `stall_s` (default: timeouts.stall_s) without a line, after
        its first; `kv_from`: the prefill node whose loss also ends it before its first."""
        resp = await self._open(url, path, msg, self.timeouts.first_byte_s)
        stall = self.timeouts.stall_s if stall_s is None else stall_s
        stream = NodeStream(
            url, request_id, resp, self.timeouts.read_line_s, stall, kv_from, self._stream_closed
        )
        self._streams.add(stream)
        return stream

    # -- internals ---------------------------------------------------------------------------

    def _stream_closed(self, stream: NodeStream) -> None:
        self._streams.discard(stream)
        if stream.heard > self._heard.get(stream.url, float("-inf")):
            self._heard[stream.url] = stream.heard

    def _answered(self, url: str) -> None:
        self._heard[url] = asyncio.get_running_loop().time()

    def _no_connection(self, url: str) -> NodeUnreachable:
        """No connection within the connect timeout (a partition, a node gone silent): the
        request was never sent, so another node may take it."""
        return NodeUnreachable(url, f"no connection within {self.timeouts.connect_s:g} s")

    async def _guarded(self, url: str, call: Awaitable[T]) -> T:
        """`call`, unless `abort(url)` ends it first (NodeUnreachable).

        The call runs in the caller's task (a task of its own costs a turn of the event loop
        before it starts and another when it ends: 0.1 ms of a request's TTFT at p50 under
        load); `abort` cancels the caller's task, and the cancellation it caused is taken
        back here and turned into its error, as `asyncio.timeout` does with its own."""
        task = asyncio.current_task()
        assert task is not None, "a guarded call runs in a task"
        guard = _Guard(task)
        self._calls.setdefault(url, set()).add(guard)
        try:
            return await call
        except asyncio.CancelledError:
            # Ours (the guard tripped) and nobody else's: raise its error. Anything else is
            # a real cancellation of this task: let it through.
            if guard.tripped and task.uncancel() == 0:
                guard.tripped = False
                assert guard.error is not None
                raise guard.error from None
            guard.tripped = False  # uncancelled above, or the outer cancellation wins
            raise
        finally:
            guard.active = False
            if guard.tripped:  # the call turned the cancellation into something else
                task.uncancel()
            calls = self._calls.get(url)
            if calls is not None:
                calls.discard(guard)
                if not calls:
                    del self._calls[url]

    def _control(self) -> aiohttp.ClientTimeout:
        return self._total(self.timeouts.control_s)

    def _total(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self.timeouts.connect_s)

    async def _call(
        self, url: str, path: str, msg: Message, result: type[R], timeout: aiohttp.ClientTimeout
    ) -> R:
        try:
            async with self.session.post(
                url + path, data=to_json(msg), headers=JSON_HEADERS, timeout=timeout
            ) as resp:
                self._answered(url)
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
            raise transport_error(url, path, e) from None
        try:
            return from_json(body, result)
        except MessageError as e:
            raise BackendError.failed(f"node {url} answered {path} with garbage: {e}") from None

    async def _error(self, url: str, resp: aiohttp.ClientResponse | http1.Response) -> Exception:
        """The exception for a non-200 answer, from its OpenAI-style error body."""
        try:
            async with asyncio.timeout(self.timeouts.control_s):
                raw = await resp.content.read(MAX_ERROR_BODY)
        except (aiohttp.ClientError, http1.HttpError, asyncio.TimeoutError):
            raw = b""
        return status_error(url, resp.status, resp.headers.get("Retry-After"), raw)

    async def _cancel_quietly(self, url: str, request_id: str, choice: int | None) -> None:
        deadline = asyncio.get_running_loop().time() + self.timeouts.cancel_retry_s
        backoff = 0.5
        while True:
            try:
                result = await self.cancel(url, request_id, choice)
            except BackendError as e:
                # Unreachable or no answer: it may be hung or restarting; anything else (a
                # refusal) will not change.
                again = e.status >= 500 and asyncio.get_running_loop().time() + backoff < deadline
                log.info(
                    "cancel %s on %s failed%s: %s",
                    request_id, url, f"; again in {backoff:g} s" if again else "", e.message,
                )  # fmt: skip
                if not again:
                    return
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 15.0)
                continue
            log.debug("cancel %s on %s: stage=%s", request_id, url, result.stage)
            if self.on_cancel is not None:
                self.on_cancel(url, result)
            return


class _Guard:
    """A call in flight to one node, in `task`; `trip` ends it with an error for its caller
    (by cancelling the task, which `NodeClient._guarded` takes back)."""

    __slots__ = ("task", "error", "active", "tripped")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.error: NodeUnreachable | None = None
        self.active = True  # until the guarded call returned or raised
        self.tripped = False  # cancelled the task, not yet taken back

    def trip(self, error: NodeUnreachable) -> None:
        if not self.active or self.tripped or self.error is not None:
            return
        self.error = error
        if self.task is asyncio.current_task():
            return  # called from inside the call itself: it is failing on its own already
        self.tripped = True
        self.task.cancel()
