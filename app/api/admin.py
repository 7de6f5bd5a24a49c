"""Admin actions on the appliance itself: pause, resume, shut down (admin token only), and
the identity challenge that clients holding the token send before they trust this server
with it."""

from __future__ import annotations

import asyncio
import signal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from app.gates.admin_token import require_admin
from app.host.token_file import NONCE_BYTES, identity_proof
from app.http.scope import listening_address
from app.http.state import state_of
from app.schemas import ErrorResponse, IdentityProof

router = APIRouter()
admin = APIRouter(dependencies=[Depends(require_admin)],
                  responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})


class Challenge(BaseModel):
    nonce: str = Field(pattern=f"^[0-9a-f]{{{2 * NONCE_BYTES}}}$",
                       description=f"{NONCE_BYTES} random bytes in lower-case hex, new for "
                       "every challenge.")


@router.post("/v1/identity", response_model=IdentityProof,
             responses={400: {"model": ErrorResponse}},
             summary="Prove this is the vramguard that holds the admin token")
async def identity(request: Request, body: Challenge) -> IdentityProof:
    """Answers HMAC-SHA256(admin token, nonce ‖ address ‖ port), over the address and port
    this connection reached (the listening socket's own). The tray, `vramguard stop`, a
    second launch and the clients check it against where they connected before they send
    the token or an image: a program that took the port cannot answer, and one that
    passes the challenge on to a real vramguard elsewhere (another port, or the other
    loopback family: ``::1`` behind ``127.0.0.1``) gets an answer bound to that
    elsewhere."""
    state = state_of(request)
    host, port = listening_address(request.scope, state.settings.host, state.settings.port)
    proof = identity_proof(state.admin_token.current(), bytes.fromhex(body.nonce), host, port)
    return IdentityProof(proof=proof)


@admin.post("/v1/admin/pause", summary="Stop taking images (they get 503) (admin)")
async def pause(request: Request) -> dict[str, bool]:
    state_of(request).engine.paused = True
    return {"paused": True}


@admin.post("/v1/admin/resume", summary="Take images again (admin)")
async def resume(request: Request) -> dict[str, bool]:
    state_of(request).engine.paused = False
    return {"paused": False}


@admin.post("/v1/admin/shutdown", summary="Finish what is queued, then exit (admin)")
async def shutdown() -> dict[str, str]:
    # The same path as Ctrl+C: uvicorn stops accepting, drains, runs the lifespan's
    # shutdown and exits 0. Raised after this answer has gone out.
    asyncio.get_running_loop().call_later(0.2, signal.raise_signal, signal.SIGINT)
    return {"status": "shutting down"}


router.include_router(admin)
