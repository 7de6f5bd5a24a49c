"""A click on the icon where pystray's backend has no menu: it opens the dashboard.

On Linux without GTK and PyGObject (the README's install), pystray falls back to its
xorg backend, which has no menu (``HAS_MENU`` false) and only a default action. pystray
0.19 runs that action from a ButtonPress handler, but creates the icon's window with an
event mask of ``ExposureMask | StructureNotifyMask`` only. X delivers a button press to a
client only for the windows it selected ``ButtonPressMask`` on; for the others the press
goes on to the parent, here the tray host's window (tint2's) the icon is embedded in. So
the handler never ran, and a click did nothing.

``accept_clicks`` selects button presses on the icon's window and puts its own handler in
their place: a left or a right click (a right click has no menu to open here) runs the
action on a thread of its own, so an HTTP call neither freezes the icon's X loop nor ends
it with an exception (pystray's loop ends at the first one). Presses within
``REPEAT_MS`` of the last one handled (a double click, by the X server's own clock) are
the same click: one dashboard opens, not two.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vramguard.tray")
CLICK_BUTTONS = (1, 3)  # left, right; 2 is the middle button, 4 and 5 the wheel
REPEAT_MS = 1000


class ClickHandler:
    """Runs ``action`` once per click; presses come from the icon's X loop."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action
        self._last_ms: int | None = None

    def press(self, button: int, time_ms: int) -> bool:
        """A button press at ``time_ms`` (the X server's timestamp): whether it starts the
        action."""
        if button not in CLICK_BUTTONS:
            return False
        if self._last_ms is not None and 0 <= time_ms - self._last_ms < REPEAT_MS:
            return False
        self._last_ms = time_ms
        threading.Thread(target=self._run, name="tray-click", daemon=True).start()
        return True

    def _run(self) -> None:
        try:
            self.action()
        except Exception:
            log.exception("tray: a click on the icon failed")


def accept_clicks(icon: Any, action: Callable[[], None]) -> ClickHandler | None:
    """Make a click on ``icon`` run ``action``, where its backend has no menu and is
    pystray's xorg backend; None where that is not the case (nothing is changed then).
    Call before ``icon.run`` (the icon's X loop is not running yet)."""
    if icon.HAS_MENU:
        return None
    window = getattr(icon, "_window", None)
    handlers = getattr(icon, "_message_handlers", None)
    if window is None or not isinstance(handlers, dict):
        log.warning("tray: this tray backend has no menu and takes no clicks")
        return None
    x = importlib.import_module("Xlib.X")
    clicks = ClickHandler(action)
    handlers[x.ButtonPress] = lambda event: clicks.press(event.detail, event.time)
    window.change_attributes(
        event_mask=x.ExposureMask | x.StructureNotifyMask | x.ButtonPressMask)
    icon._display.flush()
    log.warning("tray: the icon has no menu on this desktop (GTK and PyGObject give it one, "
                "see the README); a click on the icon opens the dashboard")
    return clicks
