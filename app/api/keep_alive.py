"""Who asks for a model, and for how long it may stay: a request's ``keep_alive`` and the
caller it comes from.

The rule (``Residency.lengthen``): without the admin token a request's ``keep_alive`` only
lengthens its model's stay, up to ``max_keep_alive_s``; a shorter one (``0`` included) or
``-1`` is served and leaves the stay as it was. Otherwise one app's ``keep_alive=0``
unloaded the model another app kept for an hour, and ``-1`` kept one loaded for ever. An
app that wants the memory back unloads with the token (the clients' ``unload_model``, the
tray). With the token, any value, as asked. What was not done as asked is said in the
answer's ``X-Vramguard-Keep-Alive`` header (``HEADER``), so an app can tell.

The caller is the rate limiter's client (``client_key``: the peer plus its
``X-Client-Id``; a holder of the admin token apart), so the loads a request causes are
charged to the app that sent it (``LoadRate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Query, Request, Response

from app.engine.residency import StayNote
from app.errors import Unauthorized
from app.gates.admin_token import check_bearer
from app.http.scope import ADMIN_CALLER, client_key
from app.http.state import state_of

HEADER = "X-Vramguard-Keep-Alive"
_REPLY = "vramguard.keep_alive_reply"  # in the scope: the answer's headers, for HEADER
MAX_ASKED_S = 86400 * 365
HEADER_DOC = {HEADER: {"description": "Only when the request's keep_alive was not done as "
                       "asked: \"ignored; …\" or \"capped; …\", and why.",
                       "schema": {"type": "string"}}}
"""The header in the OpenAPI document of each route that takes ``keep_alive``."""


@dataclass(frozen=True)
class Caller:
    """Whom a request's loads are charged to, and whether it holds the admin token."""

    client: str
    admin: bool


# A request whose caller is not passed (the image stream's, until it passes its own):
# never the admin, one share of loads for all such requests.
UNNAMED = Caller("requests that name no caller", admin=False)


def caller_of(request: Request) -> Caller:
    """The request's caller: the admin token (never a dashboard session) sets it apart."""
    try:
        check_bearer(request.headers.get("authorization"),
                     state_of(request).admin_token.current())
    except Unauthorized:
        return Caller(client_key(request.scope), admin=False)
    return Caller(client_key(request.scope) + ADMIN_CALLER, admin=True)


def keep_alive_query(
    request: Request, response: Response,
    keep_alive: Annotated[float | None, Query(
        ge=-1, le=MAX_ASKED_S,
        description="Seconds the model stays loaded after each use, at least. A request "
        "can only lengthen a model's stay, up to the max_keep_alive_s setting (1 hour by "
        "default); a shorter stay, 0 (unload when done) or -1 (for ever) needs the admin "
        "token. Otherwise the request is served, the stay is left as it was, and the "
        f"answer's {HEADER} header says so. Default: the keep_alive_s setting.")] = None,
) -> float | None:
    """The query's ``keep_alive``; keeps the answer's headers, for ``say``."""
    request.scope[_REPLY] = response
    return keep_alive


def note_text(note: StayNote, cap_s: float) -> str:
    """The header's value: what happened first (``ignored`` or ``capped``), then why."""
    if note is StayNote.CAPPED:
        return f"capped; the longest stay a request may ask for is {cap_s:g} s"
    return "ignored; shorter stays and -1 need the admin token"


def say(request: Request, note: StayNote | None) -> None:
    """Put ``note`` in the answer's ``HEADER`` (nothing when the keep-alive was done as
    asked, or the route has no ``keep_alive``)."""
    response = request.scope.get(_REPLY)
    if note is not None and isinstance(response, Response):
        response.headers[HEADER] = note_text(note, state_of(request).settings.max_keep_alive_s)
