"""A streamed prefill call (POST /internal/prefill_streamed): the KV handle first, as soon as
the prefill node took the request, then the first token.

    line 1  PrefillAccepted{kv}    the proxy engages a decode node with it at once
    line 2  PrefillResult          the first token (the KV keeps moving meanwhile), or a
            TokenDelta with error  the node failed or cancelled the request

Each line is read within the prefill timeout, and `NodeClient.abort(url)` (the node is
down) ends a read in flight, as for a plain prefill call. A stream that breaks or ends early
is `NodeUnreachable` (maybe received): the node is gone, another may take the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from common.wire.messages import Message, MessageError
from common.wire.node_messages import PrefillAccepted, PrefillResult, TokenDelta, from_json
from proxy.http.backend import BackendError
from proxy.pool.http1 import HttpError, Response
from proxy.pool.node_errors import NodeUnreachable

R = TypeVar("R", bound=Message)
T = TypeVar("T")
Guard = Callable[[str, Awaitable[bytes]], Awaitable[bytes]]


class PrefillStream:
    """One streamed prefill's response; `close()` drops it (the node then cancels)."""

    def __init__(
        self,
        url: str,
        request_id: str,
        resp: Response,
        timeout_s: float,
        guard: Guard,
    ) -> None:
        self.url = url
        self.request_id = request_id
        self._resp = resp
        self._timeout_s = timeout_s
        self._guard = guard

    async def accepted(self) -> PrefillAccepted:
        return await self._read(PrefillAccepted)

    async def result(self) -> PrefillResult:
        return await self._read(PrefillResult)

    def close(self) -> None:
        self._resp.close()

    async def _read(self, cls: type[R]) -> R:
        # asyncio.timeout, not wait_for: wait_for runs the read in a task of its own, a turn
        # of the event loop even when the line is in the buffer already (the result line
        # usually is, right behind the KV handle's), and the loop turn lets the inter-stage
        # dispatch of this very request run first: 0.27 ms of TTFT at p50 under load.
        try:
            async with asyncio.timeout(self._timeout_s):
                line = await self._guard(self.url, self._resp.content.readline())
        except asyncio.TimeoutError:
            raise BackendError.failed(
                f"prefill node {self.url} sent no {cls.TYPE} within {self._timeout_s:g} s"
            ) from None
        except HttpError as e:  # it took the request, then its connection broke
            raise NodeUnreachable(self.url, f"broke off: {e!r}", maybe_received=True) from None
        if not line.strip():
            raise NodeUnreachable(self.url, "ended the stream early", maybe_received=True)
        try:
            msg = from_json(line, cls)
        except MessageError as e:  # (parsed once more only when it is not the record expected)
            raise self._not(line, e) from None
        if getattr(msg, "request_id", None) != self.request_id:
            raise BackendError.failed(f"prefill node {self.url} answered another request")
        return msg

    def _not(self, line: bytes, bad: MessageError) -> BackendError:
        """What a line that is not the record expected says: the node's error line
        (a TokenDelta with error), or nothing we understand."""
        try:
            error = from_json(line, TokenDelta)
        except MessageError:
            return BackendError.failed(f"prefill node {self.url} sent a bad line: {bad}")
        if error.error_code == "cancelled":
            return BackendError.refused(f"prefill node {self.url}: {error.error}")
        return BackendError.failed(f"prefill node {self.url} failed: {error.error}")
