"""The HTTP endpoints, one module per area; ``ROUTERS`` is what ``create_app`` mounts.

Handlers only await: CPU work goes to the CPU pool, model work to the device thread.
"""

from __future__ import annotations

from fastapi import APIRouter

from app.api import (
    admin,
    classify,
    embed,
    events,
    memory,
    models,
    oip,
    status,
    stream,
    support,
    ui,
    use_page,
)

ROUTERS: tuple[APIRouter, ...] = (classify.router, stream.router, embed.router, models.router,
                                  memory.router, events.router, status.router, admin.router,
                                  ui.router, use_page.router, support.router,
                                  oip.router)
