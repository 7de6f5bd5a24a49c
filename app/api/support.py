"""``GET /v1/support-report``: the support report as a download (admin: the tray's token,
or the dashboard it opened). What goes in, and what never does, is in
``app/host/support_bundle.py``; here it is gathered from the running server, without
loading anything: doctor's lines about this computer, the memory report, the counters,
the models and the settings in force.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from app.api import models, status
from app.config import config_file_of, default_config_file
from app.engine.system_checks import Checks, system_checks
from app.errors import ApiError
from app.gates.admin_token import require_admin
from app.host.support_bundle import build_report, log_tails
from app.http.state import AppState, state_of
from app.schemas import ErrorResponse

router = APIRouter(dependencies=[Depends(require_admin)],
                   responses={401: {"model": ErrorResponse}})


def _computer(state: AppState) -> str:
    """doctor's lines up to the device (they load native libraries: not on the loop)."""
    settings = state.settings
    checks = system_checks(settings, config_file_of(settings) or default_config_file(),
                           Checks())
    return checks.text()


async def _memory(request: Request) -> Any:
    engine = state_of(request).engine
    try:
        engine.require_runtime()
    except ApiError as exc:  # still starting, or no model loaded: say so in the report
        return {"no memory report": str(exc)}
    return (await engine.on_device(engine.memory_report)).model_dump(mode="json")


@router.get("/v1/support-report", summary="A support report to attach to a bug report "
            "(admin)", response_class=Response,
            responses={200: {"content": {"application/zip": {}},
                             "description": "A zip file of logs, checks and settings, "
                             "without the admin token or the API key."}})
async def support_report(request: Request) -> Response:
    state = state_of(request)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parts: dict[str, object] = {
        "README.txt": "vramguard support report, made " + time.strftime("%Y-%m-%d %H:%M:%S %z")
                      + ". The admin token and the API key are left out.\n",
        "doctor.txt": await state.pool.run(_computer, state),
        "memory.json": await _memory(request),
        "stats.json": (await status.stats(request)).model_dump(mode="json"),
        "models.json": (await models.models(request)).model_dump(mode="json"),
        "settings.json": state.settings.model_dump(mode="json"),
    }
    secrets = [state.admin_token.current(), state.api_key or ""]
    logs = await state.pool.run(log_tails, state.settings.log_dir)
    report = await state.pool.run(build_report, parts, logs, secrets)
    return Response(report, media_type="application/zip",
                    headers={"Content-Disposition":
                             f'attachment; filename="vramguard-support-{stamp}.zip"',
                             "Cache-Control": "no-store"})
