"""The mapping of every failure to the JSON error shape ``{"error": {"code", "message"}}``
(``{"error": "message"}`` under /v2: ``app.gates.error_response``), each answer counted by
outcome code."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from app.errors import ApiError, BadRequest, ClientGone, InternalError, MethodNotAllowed, NotFound
from app.gates import error_response
from app.http.state import state_of

log = logging.getLogger("vramguard.server")


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("query", "body"))
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "Invalid request: " + "; ".join(parts)


def _answer(request: Request, error: ApiError,
            headers: Mapping[str, str] | None = None) -> JSONResponse:
    state_of(request).stats.failed(error.code, request.scope)
    response = error_response(error, request.scope["path"])
    response.headers.update(headers or {})
    return response


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, ApiError):
        raise TypeError(f"registered for ApiError, got {type(exc).__name__}")
    return _answer(request, exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RequestValidationError):
        raise TypeError(f"registered for RequestValidationError, got {type(exc).__name__}")
    return _answer(request, BadRequest(validation_message(exc)))


def hung_up() -> ClientGone:
    return ClientGone("The client disconnected before its upload had arrived.")


async def _on_client_disconnect(request: Request, exc: Exception) -> JSONResponse:
    """A client that hangs up mid-upload is an outcome (499), not a failure to log."""
    return _answer(request, hung_up())


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, HTTPException):
        raise TypeError(f"registered for HTTPException, got {type(exc).__name__}")
    # FastAPI turns any failure while it reads a JSON body into a 400 "error parsing the
    # body": answer the real one (a body gate's 408/413/503, the client hanging up).
    if isinstance(exc.__cause__, ApiError):
        return _answer(request, exc.__cause__)
    if isinstance(exc.__cause__, ClientDisconnect):
        return _answer(request, hung_up())
    mapped: ApiError
    if exc.status_code == 404:
        mapped = NotFound(f"There is no {request.url.path} here. See /docs for the API.")
    elif exc.status_code == 405:
        mapped = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}.")
    else:
        mapped = ApiError(str(exc.detail))
        mapped.status, mapped.code = exc.status_code, "bad_request"
    return _answer(request, mapped, exc.headers)  # e.g. the Allow header of a 405


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _answer(request, InternalError(
        "Something went wrong inside vramguard. The details are in its log."))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(ClientDisconnect, _on_client_disconnect)
    app.add_exception_handler(Exception, _on_unexpected)
