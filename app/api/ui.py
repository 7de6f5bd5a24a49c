"""The dashboard page and its one-time-link sign-in (what a session may do:
``app/gates/ui_session.py``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from app.errors import Unauthorized
from app.gates.admin_token import require_admin
from app.http.state import state_of
from app.schemas import ErrorResponse

router = APIRouter()
PAGE = Path(__file__).parent.parent / "ui" / "dashboard.html"


@cache
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


class Code(BaseModel):
    code: str


# frame-ancestors 'none' (and X-Frame-Options for older browsers): no other page may show
# the dashboard in a frame and trick the user into clicking its buttons. img-src blob: lets
# the dashboard show the photo a person tried, read from their own disk.
POLICY = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
          "img-src 'self' blob:; frame-ancestors 'none'")


@router.get("/ui", response_class=HTMLResponse, summary="Live dashboard")
async def dashboard() -> HTMLResponse:
    return HTMLResponse(page(), headers={"Cache-Control": "no-store",
                                         "Content-Security-Policy": POLICY,
                                         "X-Frame-Options": "DENY"})


@router.post("/v1/admin/ui-link", dependencies=[Depends(require_admin)],
             responses={code: {"model": ErrorResponse} for code in (401, 403)},
             summary="A one-time code (and link) that opens the dashboard with the tray "
             "menu's actions (admin token only)")
async def ui_link(request: Request) -> dict[str, str]:
    """The tray builds the link itself from ``code`` (never taking a URL from a server);
    ``url`` is for scripts."""
    code = state_of(request).ui_sessions.new_code()
    return {"code": code, "url": f"{str(request.base_url).rstrip('/')}/ui#code={code}"}


@router.post("/v1/ui/session", responses={401: {"model": ErrorResponse}},
             summary="Trade a one-time code for a dashboard session")
async def ui_session(request: Request, body: Code) -> dict[str, str]:
    token = state_of(request).ui_sessions.redeem(body.code)
    if token is None:
        raise Unauthorized("This dashboard link has expired or was used already. Open the "
                           "dashboard again from the tray icon.")
    return {"token": token}
