"""The proxy's OpenAI-style errors: the shared ones from common.wire.errors."""

from common.wire.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    OVERLOADED,
    SERVER_ERROR,
    ApiError,
    internal_error,
    invalid_request,
)

__all__ = [
    "INVALID_REQUEST",
    "NOT_FOUND",
    "OVERLOADED",
    "SERVER_ERROR",
    "ApiError",
    "internal_error",
    "invalid_request",
]
