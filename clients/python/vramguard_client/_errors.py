"""One exception per error code vramguard answers, plus the client's own (nothing
listening, someone else on the port, a call that ran out of time)."""

from __future__ import annotations


class VramguardError(Exception):
    """Base of every error: the server's ``code`` and ``message``, the HTTP ``status``
    (None when no answer came), and ``retry_after``: seconds the server asked to wait."""

    code = "error"
    status: int | None = None

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BadImage(VramguardError):
    code, status = "bad_image", 400


class BadRequest(VramguardError):
    code, status = "bad_request", 400


class Unauthorized(VramguardError):
    """No admin token file, or the server refused the token."""

    code, status = "unauthorized", 401


class Forbidden(VramguardError):
    code, status = "forbidden", 403


class NotFound(VramguardError):
    code, status = "not_found", 404


class MethodNotAllowed(VramguardError):
    code, status = "method_not_allowed", 405


class RequestTimeout(VramguardError):
    code, status = "request_timeout", 408


class Conflict(VramguardError):
    """E.g. unloading a model that has images in progress."""

    code, status = "conflict", 409


class PayloadTooLarge(VramguardError):
    code, status = "payload_too_large", 413


class ImageTooLarge(VramguardError):
    code, status = "image_too_large", 413


class UnsupportedMediaType(VramguardError):
    code, status = "unsupported_media_type", 415


class ImageTooComplex(VramguardError):
    code, status = "image_too_complex", 422


class RateLimited(VramguardError):
    code, status = "rate_limited", 429


class ClientClosed(VramguardError):
    code, status = "client_closed", 499


class InternalError(VramguardError):
    code, status = "internal_error", 500


class Unavailable(VramguardError):
    """Base of the 503 answers: the appliance cannot take this image now."""

    code, status = "unavailable", 503


class Overloaded(Unavailable):
    code = "overloaded"


class DeadlineExceeded(Unavailable):
    code = "deadline_exceeded"


class NotReady(Unavailable):
    """vramguard itself is still starting."""

    code = "not_ready"


class Loading(Unavailable):
    """The model asked for is being loaded; ``retry_after`` says when to come back."""

    code = "loading"


class Paused(Unavailable):
    code = "paused"


class InsufficientMemory(Unavailable):
    code = "insufficient_memory"


class ConnectionLost(VramguardError):
    """The connection broke before the answer came (tried again within the timeout)."""

    code = "connection_lost"


class NotRunning(VramguardError):
    """Nothing listens at the appliance's address."""

    code = "not_running"


class NotVramguard(VramguardError):
    """Something answers on the port but cannot prove it holds this user's admin token;
    the token was not sent."""

    code = "not_vramguard"


class Timeout(VramguardError):
    """The call's overall ``timeout`` ran out (retries included)."""

    code = "timeout"


class UnexpectedResponse(VramguardError):
    """An answer that is not vramguard's JSON."""

    code = "unexpected_response"


BY_CODE: dict[str, type[VramguardError]] = {
    cls.code: cls for cls in (
        BadImage, BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed,
        RequestTimeout, Conflict, PayloadTooLarge, ImageTooLarge, UnsupportedMediaType,
        ImageTooComplex, RateLimited, ClientClosed, InternalError, Overloaded,
        DeadlineExceeded, NotReady, Loading, Paused, InsufficientMemory)
}


def error_for(code: str, status: int, message: str,
              retry_after: float | None) -> VramguardError:
    """The exception for the server's error ``code`` (the base class for a code this
    client does not know yet, with the server's code and status)."""
    cls = BY_CODE.get(code)
    if cls is None:
        return VramguardError(message, code=code, status=status, retry_after=retry_after)
    return cls(message, status=status, retry_after=retry_after)
