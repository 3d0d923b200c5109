"""Observation points in the HTTP layer's handling of one request.

Subclass `ProxyHooks` to add metrics (TTFT, ITL, E2E, errors, cancellations) and the
per-request ownership trace. Every method is called on the event loop, in this order for a
request that is served:

    on_received -> on_validated -> on_prepared -> on_first_token -> on_tokens* -> on_finished
      -> on_closed

and ends with exactly one of `on_finished`, `on_error` or `on_cancelled` for every request that
reached `on_received`. Hooks must be cheap and must not raise or block: they run inline in the
request's task (read `time.monotonic()` yourself; timestamps are not passed).
"""

from __future__ import annotations

from proxy.http.errors import ApiError
from proxy.http.prepare import PreparedRequest


class ProxyHooks:
    """No-op hooks; override the ones you need."""

    def on_received(self, request_id: str, endpoint: str) -> None:
        """A generation request arrived (before its body is read)."""

    def on_validated(self, request_id: str) -> None:
        """The body parsed into a valid request (before tokenization)."""

    def on_prepared(self, request_id: str, prepared: PreparedRequest) -> None:
        """Validated and tokenized; about to be handed to the backend."""

    def on_first_token(self, request_id: str) -> None:
        """The backend's first chunk arrived (streaming: the headers go out now)."""

    def on_tokens(self, request_id: str, num_tokens: int) -> None:
        """A backend chunk of ``num_tokens`` tokens arrived (the first chunk included)."""

    def on_relayed(self, request_id: str, seconds: float) -> None:
        """A streamed chunk's event was written to the client, `seconds` after its chunk
        arrived from the backend (detokenizing, stop strings, the write)."""

    def on_finished(
        self, request_id: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """The response is complete ("stop" or "length"); the backend stream is closed."""

    def on_error(self, request_id: str, error: ApiError, stream_started: bool) -> None:
        """The request ended with ``error``: an HTTP error, or a final SSE error event."""

    def on_cancelled(self, request_id: str, reason: str) -> None:
        """The client went away ("disconnect") or the server is shutting down ("cancelled");
        the backend stream is being closed."""

    def on_closed(self, request_id: str) -> None:
        """The handler is done with the request (after its terminal event); always called
        once for every request that reached `on_received`."""


class RequestEvents:
    """`ProxyHooks` bound to one request: passes on at most one terminal event (the first of
    finished / error / cancelled), so a late cancellation cannot follow a reported error."""

    def __init__(self, hooks: ProxyHooks, request_id: str) -> None:
        self.hooks = hooks
        self.request_id = request_id
        self._ended = False
        self._seen_first = False

    def tokens(self, num_tokens: int) -> None:
        if not self._seen_first:
            self._seen_first = True
            self.hooks.on_first_token(self.request_id)
        self.hooks.on_tokens(self.request_id, num_tokens)

    def relayed(self, seconds: float) -> None:
        self.hooks.on_relayed(self.request_id, seconds)

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        if self._end():
            self.hooks.on_finished(self.request_id, finish_reason, prompt_tokens, completion_tokens)

    def error(self, error: ApiError, stream_started: bool) -> None:
        if self._end():
            self.hooks.on_error(self.request_id, error, stream_started)

    def cancelled(self, reason: str) -> None:
        if self._end():
            self.hooks.on_cancelled(self.request_id, reason)

    def _end(self) -> bool:
        ended, self._ended = self._ended, True
        return not ended
