"""One request's generation as the HTTP layer sees it: the backend token stream, its text,
and the two ways to answer (an SSE stream, or one JSON body).

Ownership: `Generation` owns the backend stream from `open` until `close`; the handler calls
`close` in a `finally`, so the stream is closed (the request cancelled in the backend) on every
path: finish, stop string, error, client disconnect, handler cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web

from common.text.tokenizer import Tokenizer
from common.wire.sampling_params import CONSTRAINT_PARAM
from proxy.http.backend import BackendError, ChoiceEnds, TokenBackend, TokenStream
from proxy.http.choices import ChoiceSplit, ChoiceStream
from proxy.http.errors import SERVER_ERROR, ApiError, internal_error
from proxy.http.hooks import RequestEvents
from proxy.http.prepare import PreparedRequest
from proxy.http.protocol import Usage
from proxy.http.responses import SSE_DONE, ApiFormat, make_usage, sse_error
from proxy.http.text_stream import TextDelta, TextStream

log = logging.getLogger(__name__)
T = TypeVar("T")


class Generation:
    """The backend stream of one prepared request, rendered as text deltas."""

    def __init__(
        self,
        prep: PreparedRequest,
        backend: TokenBackend,
        tokenizer: Tokenizer,
        events: RequestEvents,
        tokens: ChoiceStream | None = None,
    ) -> None:
        """`tokens`: this choice's stream of a request of several (`ChoiceSplit`); else the
        backend's stream of `prep`, opened here."""
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
        self._tokens: TokenStream | ChoiceStream = (
            tokens if tokens is not None else backend.generate(prep.generation)
        )
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
        except BackendError as e:
            if e.param == CONSTRAINT_PARAM:  # the node's name for it: the client's field
                e.param = self.prep.constraint_param
            raise
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


async def collect(gen: Generation, fmt: ApiFormat, report: bool = True) -> dict[str, object]:
    """Run `gen` to its end; the whole response body (`report`: tell the hooks it finished;
    a batch reports once, for all its choices)."""
    parts: list[str] = []
    whole = TextDelta("")  # every delta's tokens and logprobs, in order
    while True:
        delta = await gen.next_text()
        parts.append(delta.text)
        whole = replace(delta, text="", finish_reason=None).after(whole)
        if delta.finish_reason is not None:
            break
    if report:
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
    await _end_with(resp, gen.events, error)


async def _write_events(
    resp: web.StreamResponse, gen: Generation, delta: TextDelta, fmt: ApiFormat
) -> None:
    for start in fmt.stream_start():
        await resp.write(start)
    while True:
        event = fmt.stream_delta(delta)
        if delta.finish_reason is not None:
            break
        if event is not None:
            await resp.write(event)
            gen.events.relayed(time.monotonic() - gen.arrived)
        delta = await gen.next_text()
    usage = fmt.stream_usage(gen.usage()) if gen.prep.include_usage else None
    await _end_body(resp, event, usage)
    if event is not None:
        gen.events.relayed(time.monotonic() - gen.arrived)
    gen.report_finished()


# -- several choices in one response (a batch of prompts) --------------------------------------


async def run_all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Await `coros` concurrently; on the first failure cancel the rest (and wait for them,
    so that nothing still reads a stream the caller is about to close), then raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def open_choices(
    prep: PreparedRequest, backend: TokenBackend, tokenizer: Tokenizer, events: RequestEvents
) -> list[Generation]:
    """One Generation per choice of `prep` (`n` of them), over one backend stream."""
    n = prep.generation.sampling.n
    if n == 1:
        return [Generation(prep, backend, tokenizer, events)]
    ends = ChoiceEnds()
    req = replace(prep.generation, choice_ends=ends)
    split = ChoiceSplit(backend.generate(req), n, ends)
    return [Generation(prep, backend, tokenizer, events, s) for s in split.streams]


def total_usage(gens: list[Generation]) -> Usage:
    """The usage of every choice together: each prompt once (its `n` choices share one
    prefill), every completion."""
    prompts = {g.request_id: g for g in reversed(gens)}.values()  # each prompt's choice 0
    return make_usage(
        sum(g.prep.num_prompt_tokens for g in prompts),
        sum(g.text.completion_tokens for g in gens),
        sum(g.text.cached_tokens for g in prompts),
    )


async def write_streams(
    resp: web.StreamResponse, gens: list[Generation], firsts: list[TextDelta], fmts: list[ApiFormat]
) -> None:
    """`write_stream` for several choices: each choice's events as they come, interleaved
    (each carries its choice's index); the usage chunk, for all of them, once every choice
    finished; then `[DONE]`. The first failure ends the whole stream with its error."""
    queue: asyncio.Queue[tuple[int, TextDelta] | BaseException] = asyncio.Queue()

    async def pump(i: int) -> None:
        delta = firsts[i]
        try:
            while True:
                await queue.put((i, delta))
                if delta.finish_reason is not None:
                    return
                delta = await gens[i].next_text()
        except Exception as e:  # ApiError, a bug: the writer ends the stream with it
            await queue.put(e)

    events = gens[0].events
    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(gens))]
    try:
        for fmt in fmts:
            for start in fmt.stream_start():
                await resp.write(start)
        left = len(gens)
        while left:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            i, delta = item
            event = fmts[i].stream_delta(delta)
            left -= delta.finish_reason is not None
            if event is not None and left:
                await resp.write(event)
                events.relayed(time.monotonic() - gens[i].arrived)
        usage = total_usage(gens)  # the last choice's last event goes out with it
        chunk = fmts[0].stream_usage(usage) if gens[0].prep.include_usage else None
        await _end_body(resp, event, chunk)
        if event is not None:
            events.relayed(time.monotonic() - gens[i].arrived)
        events.finished(
            gens[0].text.finish_reason or "stop", usage.prompt_tokens, usage.completion_tokens
        )
    except ConnectionError:
        log.debug("%s: client disconnected mid-stream", gens[0].request_id)
        events.cancelled("disconnect")
    except ApiError as e:
        await _end_with(resp, events, e)
    except Exception:
        log.exception("%s: stream failed", gens[0].request_id)
        await _end_with(resp, events, internal_error())
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _end_body(resp: web.StreamResponse, event: bytes | None, usage: bytes | None) -> None:
    """The last event, the usage chunk (if asked for), [DONE] and the body's end, in one
    write: one send here, one read at the client."""
    await resp.write_eof(b"".join(part for part in (event, usage, SSE_DONE) if part is not None))


async def _end_with(resp: web.StreamResponse, events: RequestEvents, error: ApiError) -> None:
    events.error(error, True)
    with contextlib.suppress(ConnectionError):  # the error event, [DONE], the body's end
        await resp.write_eof(sse_error(error) + SSE_DONE)
