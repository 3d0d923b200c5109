"""The token backend the HTTP layer consumes.

The HTTP layer owns text (tokenization, detokenization, stop strings); a backend owns
everything between token ids in and token ids out: the disaggregated pipeline (prefill pool ->
inter-stage queue -> decode pool), colocated nodes, or (in tests) an in-process engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from common.wire.logprobs import TokenLogprobs
from common.wire.sampling_params import SamplingParams
from proxy.http.errors import INVALID_REQUEST, SERVER_ERROR, ApiError

FINISH_REASONS = frozenset({"stop", "length", "abort"})


class ChoiceEnds:
    """A request of several choices (n > 1): the choices the HTTP layer is done with before
    they finished (a stop string ended their text). The backend may stop generating them:
    while a node decodes the choices, the backend `attach`es a way to end one there; an end
    asked before that, or after, is remembered, and applied at attach."""

    def __init__(self) -> None:
        self.ended: set[int] = set()
        self._stop: Callable[[int], None] | None = None

    def end(self, choice: int) -> None:
        if choice in self.ended:
            return
        self.ended.add(choice)
        if self._stop is not None:
            self._stop(choice)

    def attach(self, stop: Callable[[int], None]) -> None:
        self._stop = stop
        for choice in sorted(self.ended):
            stop(choice)

    def detach(self) -> None:
        self._stop = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request in token space: what a backend is asked to generate."""

    request_id: str  # unique per request; also the response id and the X-Request-Id
    prompt_token_ids: list[int]  # non-empty, each in [0, vocab), shorter than the context
    sampling: SamplingParams  # max_tokens already fitted to the context
    patience_s: float | None = None  # X-Request-Deadline-Ms: the longest it may wait at the edge
    # When the proxy took it (time.monotonic()): `auto`'s TTFT objective counts from here.
    arrived_s: float = field(default_factory=time.monotonic, compare=False)
    # sampling.n > 1: the choices the client is done with (the backend may stop them).
    choice_ends: ChoiceEnds | None = field(default=None, compare=False)


@dataclass(frozen=True)
class TokenChunk:
    """New token ids of one request, in order. `finish_reason` is set on the last chunk only.

    A finishing chunk's last token may be the stop token itself (EOS or one of
    `sampling.stop_token_ids`), as the engine emits it: the HTTP layer counts it and does not
    render it. `token_ids` may be empty (e.g. a finish-only chunk).
    """

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    num_cached_tokens: int | None = None  # first chunk: prompt tokens served from a cache
    # One per token id when the request asked for logprobs (`SamplingParams.logprobs`).
    logprobs: list[TokenLogprobs] | None = None
    # First chunk only, when asked (`SamplingParams.prompt_logprobs`): prompt tokens 1..
    prompt_logprobs: list[TokenLogprobs] | None = None
    choice: int = 0  # sampling.n > 1: which choice these tokens are of
    # When the proxy got it (time.monotonic()): the relay time to the client starts here.
    arrived: float = field(default_factory=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {sorted(FINISH_REASONS)}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("a chunk's logprobs are one per token id")


class BackendError(ApiError):
    """A backend refuses or fails a request.

    Raised from the token stream: before its first chunk, the client gets an HTTP error with
    this status and body (and `Retry-After` when `retry_after` is set); after, the stream ends
    with an SSE error event carrying the same body.
    """

    reject_reason: str | None = None  # set when refused before any node saw the request

    @classmethod
    def rejected(
        cls, message: str, reason: str, retry_after: float | None = None, code: str = "overloaded"
    ) -> BackendError:
        """503, before any compute: the edge (or the backend before its first node call)
        refuses the request; `reason` labels the refusal in metrics."""
        error = cls(503, message, type=SERVER_ERROR, code=code, retry_after=retry_after)
        error.reject_reason = reason
        return error

    @classmethod
    def overloaded(cls, message: str, retry_after: float | None = None) -> BackendError:
        """503: queues are full; the client should retry later."""
        return cls(503, message, type=SERVER_ERROR, code="overloaded", retry_after=retry_after)

    @classmethod
    def unavailable(cls, message: str, retry_after: float | None = None) -> BackendError:
        """503: no node can serve the request now (none registered, all down)."""
        return cls(503, message, type=SERVER_ERROR, code="unavailable", retry_after=retry_after)

    @classmethod
    def refused(cls, message: str, param: str | None = None) -> BackendError:
        """400: a node refused the request as invalid (e.g. it does not fit its KV cache)."""
        return cls(400, message, type=INVALID_REQUEST, param=param)

    @classmethod
    def failed(cls, message: str) -> BackendError:
        """502: a node failed while serving the request (died, sent garbage, timed out)."""
        return cls(502, message, type=SERVER_ERROR, code="backend_failure")


LOSS_CAUSES = ("broken", "stalled", "node_down", "role_change")


class NodeLost(BackendError):
    """A node serving a started request failed it in a way another node may not: the node
    died or hung (`node_down`), or the prompt KV could not reach the decode node. The proxy
    may continue the request elsewhere by re-prefilling the prompt plus the tokens so far.

    `cause` (one of LOSS_CAUSES; metrics count migrations by it): `broken` (the stream or
    call broke, or the node failed the request), `stalled` (the stream went silent for the
    stall timeout), `node_down` (the registry found the node unreachable), `role_change`
    (the node ended the stream to change role, after its drain timeout)."""

    def __init__(self, url: str, message: str, node_down: bool, cause: str = "broken") -> None:
        super().__init__(502, message, type=SERVER_ERROR, code="backend_failure")
        if cause not in LOSS_CAUSES:
            raise ValueError(f"unknown cause {cause!r}")
        self.url = url
        self.node_down = node_down
        self.cause = cause


TokenStream = AsyncGenerator[TokenChunk, None]


class TokenBackend(Protocol):
    """Generates token ids for validated requests.

    Contract:
    - `generate(req)` returns an async generator (write it with `async def ... yield`); work
      may start lazily, at the first `__anext__`. Errors (`BackendError`) may be raised from
      any `__anext__`, the first included.
    - It yields `TokenChunk`s in order and ends right after the chunk that carries a
      `finish_reason`. Ending without one is treated as a backend failure (502).
    - Closing it early (`aclose()`, or the consuming task cancelled while it awaits inside)
      cancels the request everywhere it is held, and must free its resources (queue entries,
      KV blocks on every node). The HTTP layer always closes it: on a stop string, on client
      disconnect, on error, on shutdown. `aclose()` should return promptly: hand slow remote
      cancels to a task the backend owns rather than awaiting a network round trip.
    - "abort" is reserved for requests the backend ended on its own (drain, shutdown); the HTTP
      layer reports it to the client as an error, not as a finish.
    """

    def generate(self, req: GenerationRequest) -> TokenStream: ...
