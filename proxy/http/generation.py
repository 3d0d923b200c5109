"""One request's generation as the HTTP layer sees it: the backend token stream, its text,
and the two ways to answer (an SSE stream, or one JSON body).

Ownership: `Generation` owns the backend stream from `open` until `close`; the handler calls
`close` in a `finally`, so the stream is closed (the request cancelled in the backend) on every
path: finish, stop string, error, client disconnect, handler cancellation.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from aiohttp import web

from common.text.tokenizer import Tokenizer
from proxy.http.backend import BackendError, TokenBackend, TokenStream
from proxy.http.errors import SERVER_ERROR, ApiError, internal_error
from proxy.http.hooks import RequestEvents
from proxy.http.prepare import PreparedRequest
from proxy.http.protocol import Usage
from proxy.http.responses import SSE_DONE, ApiFormat, make_usage, sse_error
from proxy.http.text_stream import TextDelta, TextStream

log = logging.getLogger(__name__)


class Generation:
    """The backend stream of one prepared request, rendered as text deltas."""

    def __init__(
        self,
        prep: PreparedRequest,
        backend: TokenBackend,
        tokenizer: Tokenizer,
        events: RequestEvents,
    ) -> None:
        self.prep = prep
        self.events = events
        sampling = prep.generation.sampling
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(tokenizer.eos_token_ids)
        self.text = TextStream(
            tokenizer,
            prep.generation.prompt_token_ids,
            prep.stop,
            stop_ids,
            sampling.min_tokens,
            prep.echo,
        )
        self._tokens: TokenStream = backend.generate(prep.generation)
        self.arrived = 0.0  # when the last backend chunk arrived (time.monotonic())

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    def usage(self) -> Usage:
        return make_usage(
            self.prep.num_prompt_tokens, self.text.completion_tokens, self.text.cached_tokens
        )

    async def close(self) -> None:
        """Close the backend stream (idempotent); cancels the request if it is still running."""
        try:
            await self._tokens.aclose()
        except Exception:  # a backend bug must not turn a sent response into an error
            log.exception("%s: closing the backend stream failed", self.request_id)

    async def next_delta(self) -> TextDelta:
        """The text of the next backend chunk (maybe ""); closes the stream when it finishes.

        Raises ApiError (BackendError included) when the backend fails or aborts.
        """
        try:
            chunk = await anext(self._tokens)
        except StopAsyncIteration:
            raise BackendError.failed("the backend ended the stream without finishing") from None
        self.arrived = chunk.arrived
        self.events.tokens(len(chunk.token_ids))
        delta = self.text.push(chunk)
        if delta.finish_reason is not None:
            await self.close()  # a stop string: cancel the rest of the generation now
        if delta.finish_reason == "abort":
            raise ApiError(503, "the server aborted the request", type=SERVER_ERROR, code="aborted")
        return delta

    async def next_text(self) -> TextDelta:
        """The next delta that has text or finishes (with the logprobs of any textless delta
        before it)."""
        skipped: TextDelta | None = None
        while True:
            delta = await self.next_delta()
            if skipped is not None:
                delta = delta.after(skipped)
            if delta.text or delta.finish_reason is not None:
                return delta
            skipped = delta

    def report_finished(self) -> None:
        assert self.text.finish_reason is not None
        usage = self.usage()
        self.events.finished(self.text.finish_reason, usage.prompt_tokens, usage.completion_tokens)


async def collect(gen: Generation, fmt: ApiFormat) -> dict[str, object]:
    """Run `gen` to its end; the whole response body."""
    parts: list[str] = []
    whole = TextDelta("")  # every delta's tokens and logprobs, in order
    while True:
        delta = await gen.next_text()
        parts.append(delta.text)
        whole = replace(delta, text="", finish_reason=None).after(whole)
        if delta.finish_reason is not None:
            break
    gen.report_finished()
    whole = replace(whole, text="".join(parts), finish_reason=delta.finish_reason)
    return fmt.response(whole, gen.usage())


async def write_stream(
    resp: web.StreamResponse, gen: Generation, first: TextDelta, fmt: ApiFormat
) -> None:
    """Write the SSE body of a started stream, ending with `[DONE]`, or with an error event
    then `[DONE]` if the generation fails. Returns quietly when the client is gone."""
    try:
        await _write_events(resp, gen, first, fmt)
        return
    except ConnectionError:  # the client went away; aiohttp reports it on write
        log.debug("%s: client disconnected mid-stream", gen.request_id)
        gen.events.cancelled("disconnect")
        return
    except ApiError as e:
        error = e
    except Exception:
        log.exception("%s: stream failed", gen.request_id)
        error = internal_error()
    gen.events.error(error, True)
    with contextlib.suppress(ConnectionError):
        await resp.write(sse_error(error))
        await resp.write(SSE_DONE)


async def _write_events(
    resp: web.StreamResponse, gen: Generation, delta: TextDelta, fmt: ApiFormat
) -> None:
    for start in fmt.stream_start():
        await resp.write(start)
    while True:
        event = fmt.stream_delta(delta)
        if event is not None:
            await resp.write(event)
            gen.events.relayed(time.monotonic() - gen.arrived)
        if delta.finish_reason is not None:
            break
        delta = await gen.next_text()
    if gen.prep.include_usage:
        await resp.write(fmt.stream_usage(gen.usage()))
    await resp.write(SSE_DONE)
    gen.report_finished()
