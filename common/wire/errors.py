"""OpenAI-style API errors: one exception type, one body shape.

Every error a pdserve HTTP server (proxy or node) answers, whether found by
validation, raised by a backend or caught as a bug, leaves as
``{"error": {"message", "type", "param", "code"}}`` with an HTTP status (before a
stream started) or as the last SSE event of a stream (after). Never a traceback.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"


class ApiError(Exception):
    """An error with everything the HTTP layer needs to answer it.

    ``status``: the HTTP status (4xx: the client's fault, 5xx: ours or a node's);
    ``type`` / ``param`` / ``code``: the OpenAI error fields; ``retry_after``: seconds for a
    ``Retry-After`` header (overload), when known.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, code={self.code!r})"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request is malformed or asks for something we do not serve."""
    return ApiError(400, message, param=param, code=code)


def internal_error(message: str = "internal server error") -> ApiError:
    """500: a bug on our side; the message never carries internals."""
    return ApiError(500, message, type=SERVER_ERROR, code="internal_error")


def error_response(err: ApiError) -> web.Response:
    """The aiohttp response for `err`: its status, OpenAI body and headers."""
    return web.json_response(err.body(), status=err.status, headers=err.headers())
