"""Errors a client can be told about, each with its HTTP status and a stable code.

Every failure that reaches a client is one of these, rendered as
``{"error": {"code", "message"}}``; the message is written for a person.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: decode workers load this module, not the web stack
    from starlette.responses import JSONResponse


class ApiError(Exception):
    """Base: a client-visible failure with a status, a machine code and a message."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """Retry-After in whole seconds (at least 1) when the client should come back."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def response(self) -> JSONResponse:
        """The JSON error body every client sees: ``{"error": {"code", "message"}}``."""
        from starlette.responses import JSONResponse

        return JSONResponse({"error": {"code": self.code, "message": self.message}},
                            status_code=self.status, headers=self.headers())


class BadImage(ApiError):
    status, code = 400, "bad_image"


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class NotFound(ApiError):
    status, code = 404, "not_found"


class RequestTimeout(ApiError):
    """The client stopped sending its upload part way; its connection is closed."""

    status, code = 408, "request_timeout"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class ImageTooLarge(ApiError):
    status, code = 413, "image_too_large"


class ImageTooComplex(ApiError):
    """The file is built so that opening it would cost far more computing time than an
    ordinary image of its size (crafted, or broken in an unusual way)."""

    status, code = 422, "image_too_complex"


class UnsupportedMediaType(ApiError):
    status, code = 415, "unsupported_media_type"


class Overloaded(ApiError):
    status, code = 503, "overloaded"


class DeadlineExceeded(ApiError):
    status, code = 503, "deadline_exceeded"


def too_busy_to_start() -> DeadlineExceeded:
    """The answer when a request's deadline passes before its work could even start."""
    return DeadlineExceeded("vramguard is too busy to look at this image in time. "
                            "Try again shortly.", retry_after=2)


class ModelUnusable(ApiError):
    """An own model's folder did not pass its check; the message says what is wrong."""

    status, code = 422, "model_unusable"


class NotReady(ApiError):
    """vramguard itself is starting (or stopping, or failed to start)."""

    status, code = 503, "not_ready"


class Loading(ApiError):
    """The model asked for is being loaded; Retry-After says when it should be ready."""

    status, code = 503, "loading"


class Paused(ApiError):
    status, code = 503, "paused"


class InsufficientMemory(ApiError):
    status, code = 503, "insufficient_memory"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class AdminTokenRequired(ApiError):
    """A dashboard session asked for an action only the admin token may take."""

    status, code = 403, "forbidden"


class Conflict(ApiError):
    status, code = 409, "conflict"


class ClientGone(ApiError):
    """The client disconnected before its answer was ready; nobody reads this answer, but
    it is counted (499, as nginx names it)."""

    status, code = 499, "client_closed"


class MethodNotAllowed(ApiError):
    status, code = 405, "method_not_allowed"


class InternalError(ApiError):
    status, code = 500, "internal_error"


class RateLimited(ApiError):
    status, code = 429, "rate_limited"

    def __init__(self, message: str, *, retry_after: float, limit: int, reset: float) -> None:
        super().__init__(message, retry_after=retry_after)
        self.limit = limit
        self.reset = reset

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "RateLimit-Limit": str(self.limit),
                "RateLimit-Remaining": "0", "RateLimit-Reset": str(math.ceil(self.reset))}
