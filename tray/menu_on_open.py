"""On Windows the tray's menu is built on the icon's message thread, as it opens, and
never from the update loop.

pystray's win32 ``update_menu`` destroys the menu handle and makes a new one on whichever
thread calls it (moses-palmer/pystray#60): called from the tray's update loop while the
menu is open on the screen, it made the menu vanish or lose the click, and the menu's
readings change every second on a GPU. pystray has no hook for "the menu is about to
open", so this wraps its private handler of the notification-area message
(``_message_handlers[WM_NOTIFY]``, run by the message loop): on a right-button release
it rebuilds the menu from the readings of now, then lets pystray open it. Every other
rebuild pystray makes (at start, after a click's action) is on that thread already.

Written against pystray 0.19.5, pinned in pyproject.toml; tests/unit/tray/
test_menu_on_open.py checks pystray's own source for each private part used here.
Where they are not what this was written for, ``install`` says so (False): the menu is
then built at start and after each action, never from the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PYSTRAY_VERSION = "0.19.5"
WM_USER = 0x0400
WM_NOTIFY = WM_USER + 11  # pystray._util.win32.WM_NOTIFY: its icon's callback message
WM_RBUTTONUP = 0x0205  # what the notification area sends when the menu is to open


def install(icon: Any) -> bool:
    """Rebuild ``icon``'s menu (a pystray win32 Icon, not yet running) each time it is
    about to open; False, changing nothing, when pystray's private parts differ."""
    handlers = getattr(icon, "_message_handlers", None)
    rebuild = getattr(icon, "_update_menu", None)
    if not isinstance(handlers, dict) or not callable(rebuild) or \
            not callable(handlers.get(WM_NOTIFY)):
        return False
    opens: Callable[[int, int], Any] = handlers[WM_NOTIFY]

    def on_notify(wparam: int, lparam: int) -> Any:
        if lparam == WM_RBUTTONUP:
            rebuild()  # on the message thread, before the menu is on the screen
        return opens(wparam, lparam)

    handlers[WM_NOTIFY] = on_notify
    return True
