"""An accepted NDJSON token stream from a node (decode or generate), read as TokenChunks:
lines that arrived together merged into one chunk (of one choice), a read timeout and stall
detection with one timer per stream, error lines turned into `BackendError`s (`NodeLost` for
those another node may recover from)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from common.wire.messages import MessageError
from common.wire.node_messages import TokenDelta, from_json
from proxy.http.backend import BackendError, NodeLost, TokenChunk
from proxy.pool.http1 import HttpError, Response

MAX_LINE_BYTES = 64 << 20  # a token stream's longest line (prompt logprobs make it long)
KV_ERROR_CODES = frozenset({"kv_failed", "kv_timeout", "kv_handshake"})
ROLE_CHANGE_CODE = "role_change"  # a stream the node ended to change role: continue it


class NodeStream:
    """An accepted token stream (decode or generate) of one request; one consumer owns it.

    `close()` drops the connection at once, without network I/O: the node takes the
    disconnect as a cancel. Idempotent. `abort(error)` closes it so that the reader gets
    `error`.
    """

    def __init__(
        self,
        url: str,
        request_id: str,
        resp: Response,
        read_timeout_s: float,
        stall_s: float = 0.0,
        kv_from: str | None = None,
        on_close: Callable[[NodeStream], None] | None = None,
    ) -> None:
        self.url = url
        self.request_id = request_id
        self._resp = resp
        self._read_timeout_s = read_timeout_s
        self.stall_s = stall_s  # 0: no stall detection
        self.kv_from = kv_from  # the prefill node sending its KV, until the first line
        self.received = False  # a line came
        self.heard = float("-inf")  # loop time the node last sent anything on this stream
        self._on_close = on_close
        self._aborted: NodeLost | None = None
        self._wait: tuple[float, float, bool] | None = None  # deadline, timeout, stalled
        self._watchdog: asyncio.TimerHandle | None = None
        self._lines: deque[bytes] = deque()  # received, not yet taken
        self._partial = b""  # the start of the next line
        self.events: list[tuple[str, float]] = []  # trace events the node sent, until taken

    async def next_chunk(self) -> TokenChunk:
        """The next chunk: the token lines received so far, merged into one (a reader that
        falls behind its node takes fewer, larger chunks, and relays them with one event
        each, as vLLM's output collector merges the outputs its consumer has not taken).
        The last chunk carries `finish_reason`. BackendError (502) on an error line,
        garbage, a timeout, or the stream ending without a finish."""
        while not self._lines:
            await self._fill()
        first = self._chunk(self._parse(self._lines.popleft()))
        later: list[int] = []  # token ids of the lines merged into it
        logprobs = list(first.logprobs) if first.logprobs is not None else None
        finish, merged = first.finish_reason, False
        while finish is None and self._lines:
            delta = self._parse(self._lines[0])
            if delta.error is not None or delta.choice != first.choice:
                break  # an error: the next call raises it, after these tokens are relayed
            self._lines.popleft()
            more = self._chunk(delta)
            later += more.token_ids
            if logprobs is not None:
                logprobs += more.logprobs or []
            finish, merged = more.finish_reason, True
        if not merged:
            return first
        return TokenChunk(
            first.token_ids + later,
            finish,
            first.num_cached_tokens,
            logprobs,
            first.prompt_logprobs,
            first.choice,
            first.arrived,
        )

    def close(self) -> None:
        self._resp.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._on_close is not None:
            self._on_close(self)
            self._on_close = None

    def abort(self, error: NodeLost) -> None:
        """End the stream: its reader gets `error` (now, or at its next read)."""
        if self._aborted is None:
            self._aborted = error
        self._resp.close()

    async def _fill(self) -> None:
        """Wait for more of the stream and queue its complete, non-blank lines."""
        if self._aborted is not None:
            raise self._aborted
        timeout = self._read_timeout_s
        stalled = self.received and 0 < self.stall_s < timeout
        if stalled:
            timeout = self.stall_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._wait = (deadline, timeout, stalled)
        if self._watchdog is None or self._watchdog.when() > deadline:
            if self._watchdog is not None:
                self._watchdog.cancel()
            self._watch()
        try:
            data = await self._resp.content.readany()
        except HttpError as e:
            if self._aborted is not None:
                raise self._aborted from None
            raise NodeLost(self.url, f"node {self.url} stream broke: {e!r}", True) from None
        finally:
            self._wait = None
        if self._aborted is not None:
            raise self._aborted
        if not data:
            raise NodeLost(self.url, f"node {self.url} ended the stream without finishing", True)
        self.heard = loop.time()
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > MAX_LINE_BYTES:
            raise BackendError.failed(f"node {self.url} sent a line over {MAX_LINE_BYTES} bytes")
        self._lines.extend(line for line in lines if line.strip())
        if self._lines:
            self.received, self.kv_from = True, None

    def _watch(self) -> None:
        """The read timeout, one timer per stream rather than one per read: it sleeps until
        the current wait's deadline, and ends the stream (`abort`) if a read is still waiting
        then; a read that finished in time leaves the timer to lapse."""
        self._watchdog = None
        if self._wait is None or self._aborted is not None:
            return
        deadline, timeout, stalled = self._wait
        loop = asyncio.get_running_loop()
        if loop.time() < deadline:
            self._watchdog = loop.call_at(deadline, self._watch)
            return
        cause = "stalled" if stalled else "broken"
        message = f"node {self.url} sent nothing for {timeout:g} s"
        self.abort(NodeLost(self.url, message, True, cause))

    def _parse(self, line: bytes) -> TokenDelta:
        try:
            delta = from_json(line, TokenDelta)
        except MessageError as e:
            raise BackendError.failed(f"node {self.url} sent a bad stream line: {e}") from None
        if delta.request_id != self.request_id:
            raise BackendError.failed(f"node {self.url} streamed tokens of another request")
        return delta

    def _chunk(self, delta: TokenDelta) -> TokenChunk:
        self.events += delta.events
        if delta.error is not None:
            message = f"node {self.url} failed the request: {delta.error}"
            if delta.error_code == ROLE_CHANGE_CODE:  # it moves to another pool: continue
                raise NodeLost(self.url, message, node_down=False, cause="role_change")
            if delta.error_code in KV_ERROR_CODES:  # the KV never came: re-prefill may help
                raise NodeLost(self.url, message, node_down=False)
            raise BackendError.failed(message)
        if delta.logprobs is not None and len(delta.logprobs) != len(delta.token_ids):
            raise BackendError.failed(f"node {self.url} sent logprobs that miss tokens")
        return TokenChunk(
            delta.token_ids,
            delta.finish_reason,
            delta.num_cached_tokens,
            delta.logprobs,
            delta.prompt_logprobs,
            delta.choice,
        )
