"""The OpenAPI document as vramguard really answers, where FastAPI's own guess differs.

FastAPI documents a 422 "Validation Error" (its ``HTTPValidationError``) on every route
that has parameters or a body, but vramguard answers a request that fails validation
with 400 in its own error shape (``app/api/errors.py``): ``ErrorResponse``, or
``OipError`` under ``/v2``. So that 422 is dropped and every such route documents a 400
of its shape; a 422 a route documents itself (``image_too_complex``, ``model_unusable``)
stays. The gates in front of the routes answer for any of them (too many requests, a
body too large or too slow, a page of another site): FastAPI cannot see them, so they are
added to every operation. ``tests/live/test_fuzz.py`` checks the document against live answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

GUESSED = "#/components/schemas/HTTPValidationError"
GUESS_SCHEMAS = ("HTTPValidationError", "ValidationError")


def _error_ref(path: str) -> str:
    shape = "OipError" if path.startswith("/v2") else "ErrorResponse"
    return f"#/components/schemas/{shape}"


def _is_guess(response: dict[str, Any]) -> bool:
    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
    return bool(schema.get("$ref") == GUESSED)


GATES = {"403": "Refused by the browser and address checks (a page of another site, a Host "
                "that is not this computer's)",
         "429": "Too many requests from this app, or from all of them (Retry-After says when "
                "to come back)",
         "503": "Too many connections open, or vramguard is busy (Retry-After)"}
"""What the gates in front of every route may answer (``app/gates/``, ``app/http/``)."""
BODY_GATES = {"408": "The body arrived too slowly (min_upload_bytes_per_s)",
              "413": "The body is larger than this route takes"}
"""What they may answer a request with a body, on top."""


def _refusal(path: str, description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _error_ref(path)}}}}


def corrected(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with every guessed 422 gone, the 400 vramguard answers for a request
    that fails validation on every route that has parameters or a body, and what the
    gates may answer on every route (``GATES``, ``BODY_GATES``)."""
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.get("responses", {})
            if "422" in responses and _is_guess(responses["422"]):
                del responses["422"]
            if operation.get("parameters") or operation.get("requestBody"):
                responses.setdefault("400", _refusal(
                    path, "The request's parameters or body are not valid"))
            gates = {**GATES, **(BODY_GATES if method in ("post", "put") else {})}
            for status, description in gates.items():
                responses.setdefault(status, _refusal(path, description))
    schemas = document.get("components", {}).get("schemas", {})
    for name in GUESS_SCHEMAS:
        schemas.pop(name, None)
    return document


def install(app: FastAPI) -> None:
    """Serve the corrected document at ``/openapi.json`` (built once, as FastAPI does)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = corrected(get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
