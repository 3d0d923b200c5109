"""The proxy's OpenAI-compatible HTTP surface over a `TokenBackend`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (SSE or JSON), `GET /v1/models`,
`GET /health`. A generation request goes

    read body -> parse (protocol) -> prepare (tokenize, fit context) -> backend stream
      -> text deltas (stop strings) -> SSE events or one JSON body

Streaming responses start when the backend's first chunk arrives, so an error before it
(overload, a node refusing the request) is still a plain HTTP error with its status. Serve the
app with `make_runner` (`handler_cancellation=True`): a client that disconnects while its
request waits for its first token then cancels it at once, not at the next write.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware

from common.text.tokenizer import Tokenizer
from common.wire.auth import auth_middleware
from proxy.http.backend import TokenBackend
from proxy.http.errors import NOT_FOUND, ApiError, internal_error, invalid_request
from proxy.http.generation import (
    Generation,
    collect,
    open_choices,
    run_all,
    total_usage,
    write_stream,
    write_streams,
)
from proxy.http.hooks import ProxyHooks, RequestEvents
from proxy.http.prepare import PreparedRequest, RequestPreparer
from proxy.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_request,
)
from proxy.http.responses import ApiFormat, ChatFormat, CompletionFormat, ResponseMeta

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
DEADLINE_HEADER = "X-Request-Deadline-Ms"  # the client's patience for admission
MAX_DEADLINE_MS = 24 * 3600 * 1000
SSE_HEADERS = {
    hdrs.CONTENT_TYPE: "text/event-stream",
    hdrs.CACHE_CONTROL: "no-cache",
    "X-Accel-Buffering": "no",  # no proxy buffering of the stream (nginx)
}
HealthCheck = Callable[[], Awaitable[bool]]


class SseResponse(web.StreamResponse):
    """An event stream whose headers go out with its first event, in one write. (aiohttp's
    StreamResponse sends them alone at `prepare`, its Response with the body: this is the
    same switch.) Prepared only once the first event is ready, it saves the first token a
    send here and a read at the client."""

    _send_headers_immediately = False


@dataclass(frozen=True)
class ProxyConfig:
    max_body_bytes: int = 4 * 2**20  # larger bodies get 413
    cluster_token: str | None = field(default=None, repr=False)  # for /admin/*, /debug/*
    api_key: str | None = field(default=None, repr=False)  # for /v1/*

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ProxyServer:
    """Request handlers; one instance per application (see `build_app`)."""

    def __init__(
        self,
        backend: TokenBackend,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        config: ProxyConfig,
        hooks: ProxyHooks,
        health_check: HealthCheck | None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.config = config
        self.hooks = hooks
        self.preparer = RequestPreparer(tokenizer, model_name, max_model_len)
        self._health_check = health_check
        self.created = int(time.time())

    # -- routes ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        rid = new_request_id("cmpl")

        async def prepare(text: str) -> PreparedRequest:
            req = parse_request(CompletionRequest, text)
            self.hooks.on_validated(rid)
            return await self.preparer.completion(rid, req)

        return await self._generate(request, rid, "completions", prepare, CompletionFormat)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        rid = new_request_id("chatcmpl")

        async def prepare(text: str) -> PreparedRequest:
            req = parse_request(ChatCompletionRequest, text)
            self.hooks.on_validated(rid)
            return await self.preparer.chat(rid, req)

        return await self._generate(request, rid, "chat.completions", prepare, ChatFormat)

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)
        return web.json_response(ModelList(data=[card]).model_dump(mode="json"))

    async def health(self, request: web.Request) -> web.Response:
        healthy = self._health_check is None or await self._health_check()
        return web.json_response(
            {"status": "ok" if healthy else "unavailable"}, status=200 if healthy else 503
        )

    # -- generation --------------------------------------------------------------------------

    async def _generate(
        self,
        request: web.Request,
        rid: str,
        endpoint: str,
        prepare: Callable[[str], Coroutine[Any, Any, PreparedRequest]],
        fmt_cls: Callable[[ResponseMeta], ApiFormat],
    ) -> web.StreamResponse:
        self.hooks.on_received(rid, endpoint)
        try:
            return await self._handle(request, rid, prepare, fmt_cls)
        finally:
            self.hooks.on_closed(rid)

    async def _handle(
        self,
        request: web.Request,
        rid: str,
        prepare: Callable[[str], Coroutine[Any, Any, PreparedRequest]],
        fmt_cls: Callable[[ResponseMeta], ApiFormat],
    ) -> web.StreamResponse:
        events = RequestEvents(self.hooks, rid)
        try:
            patience_s = read_deadline(request)
            prep = await prepare(await read_json_text(request, self.config.max_body_bytes))
            if patience_s is not None:
                prep = replace(prep, generation=replace(prep.generation, patience_s=patience_s))
            self.hooks.on_prepared(rid, prep)
            meta = ResponseMeta(
                rid, self.model_name, int(time.time()), prep.include_usage,
                self.tokenizer.token_bytes, prep.tool_call,
            )  # fmt: skip
            if prep.also or prep.generation.sampling.n > 1:
                return await self._run_many(request, [prep, *prep.also], fmt_cls, meta, events)
            return await self._run(request, prep, fmt_cls(meta), events)
        except ApiError as e:
            events.error(e, False)
            return error_response(e, rid)
        except ConnectionError:  # the client left before its response started
            events.cancelled("disconnect")
            return web.Response(status=499)  # never delivered; for the access log
        except asyncio.CancelledError:  # the client left (handler cancellation), or shutdown
            events.cancelled("disconnect" if _client_gone(request) else "cancelled")
            raise
        except Exception:  # a bug (ours or the backend's): a 500 body, never a traceback
            log.exception("%s: request failed", rid)
            events.error(internal_error(), False)
            return error_response(internal_error(), rid)

    async def _run(
        self, request: web.Request, prep: PreparedRequest, fmt: ApiFormat, events: RequestEvents
    ) -> web.StreamResponse:
        gen = Generation(prep, self.backend, self.tokenizer, events)
        try:
            if not prep.stream:
                body = await collect(gen, fmt)
                return web.json_response(body, headers={REQUEST_ID_HEADER: prep.request_id})
            first = await gen.next_delta()  # errors before this point are plain HTTP errors
            resp = SseResponse(headers={**SSE_HEADERS, REQUEST_ID_HEADER: prep.request_id})
            await resp.prepare(request)
            await write_stream(resp, gen, first, fmt)
            return resp
        finally:
            await gen.close()

    async def _run_many(
        self,
        request: web.Request,
        preps: list[PreparedRequest],
        fmt_cls: Callable[..., ApiFormat],
        meta: ResponseMeta,
        events: RequestEvents,
    ) -> web.StreamResponse:
        """Several choices (`n` of each prompt of a batch, in that order), generated
        concurrently, one response."""
        gens = [g for p in preps for g in open_choices(p, self.backend, self.tokenizer, events)]
        fmts = [fmt_cls(meta, i) for i in range(len(gens))]
        headers = {REQUEST_ID_HEADER: preps[0].request_id}
        try:
            if not preps[0].stream:
                jobs = [collect(g, f, report=False) for g, f in zip(gens, fmts, strict=True)]
                bodies = await run_all(jobs)
                body = bodies[0]
                body["choices"] = [b["choices"][0] for b in bodies]  # type: ignore[index]
                usage = total_usage(gens)
                body["usage"] = usage.model_dump(mode="json")
                events.finished(_finish_reason(gens), usage.prompt_tokens, usage.completion_tokens)
                return web.json_response(body, headers=headers)
            firsts = await run_all([g.next_delta() for g in gens])
            resp = SseResponse(headers={**SSE_HEADERS, **headers})
            await resp.prepare(request)
            await write_streams(resp, gens, firsts, fmts)
            return resp
        finally:
            for g in gens:
                await g.close()


def _finish_reason(gens: list[Generation]) -> str:
    return gens[0].text.finish_reason or "stop"


# -- request bodies and errors ---------------------------------------------------------------


def read_deadline(request: web.Request) -> float | None:
    """`X-Request-Deadline-Ms` in seconds: how long the client will wait for its request to
    be admitted into the pipeline (the proxy's edge deadline applies if lower). 400 if it is
    not a positive number of milliseconds."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_DEADLINE_MS:
        raise invalid_request(
            f"the {DEADLINE_HEADER} header must be a number of milliseconds in "
            f"(0, {MAX_DEADLINE_MS}], got {raw[:40]!r}",
            param=DEADLINE_HEADER,
        )
    return ms / 1000


async def read_json_text(request: web.Request, max_bytes: int) -> str:
    """The request body as text, after content-type, size and UTF-8 checks (4xx ApiErrors)."""
    if hdrs.CONTENT_TYPE in request.headers:
        mime = request.content_type
        if mime != "application/json" and not mime.endswith("+json"):
            raise ApiError(
                415,
                f"Content-Type must be application/json, got {mime!r}",
                code="unsupported_media_type",
            )
        if request.charset not in (None, "utf-8", "utf8"):
            raise ApiError(415, "the body must be UTF-8 JSON", code="unsupported_media_type")
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(max_bytes) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_request(f"the body is not valid UTF-8: {e}", code="invalid_utf8") from None


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")


def error_response(error: ApiError, request_id: str) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id, **error.headers()}
    return web.json_response(error.body(), status=error.status, headers=headers)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own HTTP errors (404, 405, 413, ...) and bugs as OpenAI error bodies."""
    try:
        resp = await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error_type = NOT_FOUND if e.status == 404 else "invalid_request_error"
        err = ApiError(e.status, e.reason, type=error_type)
        return error_response(err, new_request_id("req"))
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(internal_error(), new_request_id("req"))
    if not resp.prepared and REQUEST_ID_HEADER not in resp.headers:
        resp.headers[REQUEST_ID_HEADER] = new_request_id("req")
    return resp


# -- assembly --------------------------------------------------------------------------------

PROXY_KEY = web.AppKey("pdserve.proxy", ProxyServer)


def build_app(
    backend: TokenBackend,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    *,
    config: ProxyConfig | None = None,
    hooks: ProxyHooks | None = None,
    health_check: HealthCheck | None = None,
) -> web.Application:
    """The proxy application. `app[PROXY_KEY]` is its `ProxyServer`; add routes (metrics,
    admin) and `cleanup_ctx` entries (backend lifecycle) before starting it."""
    config = config or ProxyConfig()
    server = ProxyServer(
        backend, tokenizer, model_name, max_model_len, config, hooks or ProxyHooks(), health_check
    )
    middlewares: list[Middleware] = [error_middleware]
    if config.cluster_token is not None or config.api_key is not None:
        middlewares.append(auth_middleware(config.cluster_token, config.api_key))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[PROXY_KEY] = server
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    return app


def make_runner(app: web.Application, *, shutdown_timeout: float = 10.0) -> web.AppRunner:
    """The runner to serve the proxy with: disconnects cancel handlers, and shutdown cancels
    in-flight requests (closing their backend streams) after `shutdown_timeout` seconds."""
    return web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
