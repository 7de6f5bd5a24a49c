"""The HTTP gates in front of the model: Host and Origin checks, per-client rate limits,
body-size limits, and the admin token and dashboard sessions that admin calls need."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from app.errors import ApiError
from app.http.stats import RequestStats

OIP_PREFIX = "/v2"  # the Open Inference Protocol's routes (app/api/oip.py)


def error_response(error: ApiError, path: str) -> JSONResponse:
    """The answer to ``error`` for a request to ``path``, from a gate or a route alike:
    ``{"error": "message"}`` under /v2, the shape clients written for Triton or KServe
    read, and the API's ``{"error": {"code", "message"}}`` everywhere else."""
    if path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/"):
        return JSONResponse({"error": error.message}, status_code=error.status,
                            headers=error.headers())
    return error.response()


async def refuse(error: ApiError, stats: RequestStats, scope: Scope, receive: Receive,
                 send: Send) -> None:
    """Answer ``error`` from a gate. Gates answer before any route runs, so the app's
    error handlers (which count every route's errors) never see these: count them here,
    so that /v1/stats shows every refusal."""
    stats.failed(error.code, scope)
    await error_response(error, scope["path"])(scope, receive, send)
