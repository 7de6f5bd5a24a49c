"""The system-tray icon (pystray). Thin: everything it shows or does comes from
TrayController; this file only maps it onto pystray's icon and menu.

On Linux pystray's GTK backend is the one with menus (its xorg backend has
none); `import pystray` itself fails without a display, so callers check first.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from tray.controller import TrayController

log = logging.getLogger("vramguard.tray")
REFRESH_S = 1.0
MENU_LINES = 7


def display_available() -> bool:
    """Whether a tray can be shown: always on Windows/macOS, with a display on Linux."""
    if sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run_tray(controller: TrayController) -> None:
    """Show the icon until Quit; redraw it on each event from the server (at least once a
    second, which also supervises the server) from a stoppable thread."""
    import pystray

    stop = threading.Event()

    def line(index: int) -> Any:
        def text(_item: Any) -> str:
            lines = controller.lines()
            return lines[index] if index < len(lines) else ""
        return pystray.MenuItem(text, None, enabled=False,
                                visible=lambda _item: index < len(controller.lines()))

    def say(icon: Any, message: str) -> None:
        icon.notify(message, "vramguard")

    def open_dashboard(icon: Any) -> None:
        problem = controller.open_dashboard()
        if problem:
            say(icon, problem)

    def quit_tray(icon: Any) -> None:
        stop.set()
        controller.stop_following()
        controller.stop_server()
        icon.stop()

    menu = pystray.Menu(
        *(line(i) for i in range(MENU_LINES)),
        pystray.Menu.SEPARATOR,
        pystray.MenuItem("Empty cache", lambda icon: say(icon, controller.empty_cache()),
                         enabled=lambda _item: not controller.down),
        pystray.MenuItem("Reset peak", lambda icon: say(icon, controller.reset_peak()),
                         enabled=lambda _item: not controller.down),
        pystray.MenuItem("Pause", lambda icon: say(icon, controller.toggle_pause()),
                         checked=lambda _item: controller.paused,
                         enabled=lambda _item: not controller.down),
        pystray.MenuItem("Open dashboard", lambda icon: open_dashboard(icon)),
        pystray.MenuItem("Start server", lambda _icon: controller.ensure_server(),
                         visible=lambda _item: controller.down
                         and controller.start_server is not None),
        pystray.Menu.SEPARATOR,
        pystray.MenuItem("Quit", quit_tray),
    )
    icon = pystray.Icon("vramguard", controller.icon(), controller.tooltip(), menu)
    controller.notify = lambda message: say(icon, message)

    def update(icon: Any) -> None:
        icon.visible = True
        while not stop.is_set():
            controller.refresh()
            if controller.stopped:
                stop.set()
                icon.stop()
                return
            icon.icon = controller.icon()
            icon.title = controller.tooltip()
            icon.update_menu()  # Windows rebuilds menu text only here
            controller.wait_for_news(REFRESH_S)

    controller.follow()
    try:
        icon.run(update)
    except Exception as exc:
        # pystray's GTK backend closes its notification on the way out even when no
        # notification service exists (minimal desktops), and raises from there. Once
        # we have asked it to stop, that is not worth a traceback and exit status 1.
        if not stop.is_set():
            raise
        log.warning("the tray icon did not close cleanly: %s", exc)
    finally:
        stop.set()
        controller.stop_following()
