"""The system-tray icon (pystray). Thin: everything it shows or does comes from
TrayController; this file only maps it onto pystray's icon and menu.

On Linux pystray's GTK backend is the one with menus; its xorg backend (what pystray
falls back to without GTK and PyGObject) has none, so there a click on the icon opens the
dashboard, which offers the menu's actions (tray/clicks.py). `import pystray` itself
fails without a display, so callers check first.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from app.vocabulary import EMPTY_GPU_CACHE
from tray import menu_on_open as menu_opening
from tray.clicks import accept_clicks
from tray.controller import TrayController
from tray.text import MODELS_HEADING, SUPPORT_REPORT_ITEM, USE_PAGE_ITEM, fit_notification

log = logging.getLogger("vramguard.tray")
REFRESH_S = 1.0
MENU_LINES = 7
LINUX_BACKENDS = ("appindicator", "gtk", "xorg")  # pystray's own order: menus first


def load_pystray() -> ModuleType:
    """Import pystray with a backend that works here. pystray picks its backend when it
    is imported, and on Linux its own choice dies with ValueError (which it does not
    catch) where the AppIndicator typelibs are missing: so each backend is tried here,
    and logged. PYSTRAY_BACKEND, when set, is the person's choice and is kept."""
    if sys.platform in ("win32", "darwin") or os.environ.get("PYSTRAY_BACKEND"):
        return importlib.import_module("pystray")
    problems = []
    for name in LINUX_BACKENDS:
        os.environ["PYSTRAY_BACKEND"] = name
        try:
            module = importlib.import_module("pystray")
        except Exception as exc:  # ImportError, ValueError from gi, Xlib's display errors
            log.info("tray: the %s backend cannot be used here: %s", name, exc)
            problems.append(f"{name}: {exc}")
            continue
        log.info("tray: using the %s backend", name)
        return module
    del os.environ["PYSTRAY_BACKEND"]
    raise RuntimeError("no way to show a tray icon on this desktop (" +
                       "; ".join(problems) + ")")


class TrayView:
    """What the icon, its tooltip and its menu show now. Only what changed is handed to
    pystray: on Windows each new picture is written to a temporary .ico and deleted (a
    delete refused by an antivirus raises). With ``menu_on_open`` (Windows) the menu is
    never rebuilt from here, the update thread: it is built on the message thread as it
    opens (tray/menu_on_open.py, moses-palmer/pystray#60)."""

    def __init__(self, controller: TrayController, menu_on_open: bool = False) -> None:
        self.controller = controller
        self.menu_on_open = menu_on_open
        self._picture: bytes | None = None
        self._title: str | None = None
        self._menu: tuple[object, ...] | None = None

    def show(self, icon: Any) -> None:
        picture = self.controller.icon()
        if picture.tobytes() != self._picture:
            icon.icon = picture
            self._picture = picture.tobytes()
        title = self.controller.tooltip()
        if title != self._title:
            icon.title = title
            self._title = title
        menu = (tuple(self.controller.lines()), tuple(self.controller.models()),
                self.controller.down, self.controller.paused)
        if menu != self._menu and not self.menu_on_open:
            icon.update_menu()  # GTK rebuilds the menu (its models too) only here
            self._menu = menu


def update_loop(icon: Any, controller: TrayController, stop: threading.Event,
                view: TrayView) -> None:
    """Refresh the icon until the tray quits. One failed pass (a temporary file an
    antivirus holds, say) is logged and the next pass tries again: an exception ending
    this thread would freeze the tray."""
    while not stop.is_set():
        try:
            icon.visible = True
            controller.refresh()
            if controller.stopped:
                stop.set()
                icon.stop()
                return
            view.show(icon)
        except Exception:
            log.exception("tray: could not update the icon; trying again")
        controller.wait_for_news(REFRESH_S)


def display_available() -> bool:
    """Whether a tray can be shown: always on Windows/macOS, with a display on Linux."""
    if sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _say(icon: Any, message: str) -> None:
    """A notification where the backend can show one. pystray's xorg backend has none, and
    GTK's needs a notification service that a minimal desktop lacks: then the message is
    logged (a warning, so that it reaches the terminal), and nothing raises."""
    if not icon.HAS_NOTIFICATION:
        log.warning("tray: %s", message)
        return
    log.info("tray: %s", message)  # in the launcher's log too: a notification is gone soon
    try:
        icon.notify(fit_notification(message), "vramguard")
    except Exception as exc:
        log.warning("tray: %s (could not show it as a notification: %s)", message, exc)


def _say_problem(icon: Any, problem: str | None) -> None:
    if problem:
        _say(icon, problem)


def build_menu(pystray: ModuleType, controller: TrayController,
               stop: threading.Event) -> Any:
    """The menu: the readings, the models in memory (each with its Unload), the actions,
    and Open dashboard as the default (what a left click on the icon does on Windows, and
    any click where the backend has no menu).

    pystray asks for the items each time it builds the menu (``update_menu``, which
    TrayView calls when the models change), so the models section is made then, from
    the last sample: each Unload item names its model, never a position in a list that
    may have changed by the time it is clicked."""
    def line(index: int) -> Any:
        def text(_item: Any) -> str:
            lines = controller.lines()
            return lines[index] if index < len(lines) else ""
        return pystray.MenuItem(text, None, enabled=False,
                                visible=lambda _item: index < len(controller.lines()))

    def unloader(name: str) -> Callable[[Any], None]:
        return lambda icon: _say(icon, controller.unload(name))

    def models() -> list[Any]:
        entries = controller.models()
        if not entries:
            return []
        return [pystray.Menu.SEPARATOR,
                pystray.MenuItem(MODELS_HEADING, None, enabled=False),
                *(pystray.MenuItem(entry.label, pystray.Menu(
                    pystray.MenuItem(entry.unload, unloader(entry.name))))
                  for entry in entries)]

    def quit_tray(icon: Any) -> None:
        stop.set()
        controller.request_shutdown()  # the launcher ends the server it started, if any
        controller.stop_following()
        icon.stop()

    readings = tuple(line(i) for i in range(MENU_LINES))
    actions = (
        pystray.Menu.SEPARATOR,
        pystray.MenuItem(EMPTY_GPU_CACHE, lambda icon: _say(icon, controller.empty_cache()),
                         enabled=lambda _item: not controller.down),
        pystray.MenuItem("Reset peak", lambda icon: _say(icon, controller.reset_peak()),
                         enabled=lambda _item: not controller.down),
        pystray.MenuItem("Pause", lambda icon: _say(icon, controller.toggle_pause()),
                         checked=lambda _item: controller.paused,
                         enabled=lambda _item: not controller.down),
        pystray.MenuItem("Open dashboard",
                         lambda icon: _say_problem(icon, controller.open_dashboard()),
                         default=True),
        pystray.MenuItem(USE_PAGE_ITEM,
                         lambda icon: _say_problem(icon, controller.open_use_page())),
        pystray.MenuItem(SUPPORT_REPORT_ITEM,
                         lambda icon: _say(icon, controller.save_support_report()),
                         enabled=lambda _item: not controller.down),
        pystray.MenuItem("Start server", lambda _icon: controller.ensure_server(),
                         visible=lambda _item: controller.down
                         and controller.start_server is not None),
        pystray.Menu.SEPARATOR,
        pystray.MenuItem("Quit", quit_tray),
    )
    return pystray.Menu(lambda: (*readings, *models(), *actions))


CRASH_MESSAGE = ("vramguard hit an unexpected problem ({kind}) and carried on. The details "
                 "are in {where}.")


def report_crashes(notify: Callable[[str], None], log_file: Path | None = None) -> None:
    """Log an exception that no one caught, in any thread, and say so in a notification.
    The windowed program has no console: without this, one in a thread vanishes, and one
    in the main thread becomes PyInstaller's modal traceback dialog."""

    def report(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        log.error("an unexpected problem: %s", error, exc_info=(kind, error, trace))
        try:
            notify(CRASH_MESSAGE.format(kind=kind.__name__, where=log_file or
                                        "the tray's log file (its folder cannot be written)"))
        except Exception:  # the icon may be gone; the log has it
            log.debug("could not show the notification", exc_info=True)

    def report_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            report(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = report
    threading.excepthook = report_thread


def run_tray(controller: TrayController, log_file: Path | None = None) -> None:
    """Show the icon until Quit; redraw it on each event from the server (at least once a
    second, which also supervises the server) from a stoppable thread. ``log_file``: the
    launcher's own log, which the crash notification names."""
    pystray = load_pystray()
    stop = threading.Event()
    icon = pystray.Icon("vramguard", controller.icon(), controller.tooltip(),
                        build_menu(pystray, controller, stop))
    controller.notify = lambda message: _say(icon, message)
    report_crashes(controller.notify, log_file)
    # where the backend has no menu, a click opens the dashboard (the default item)
    accept_clicks(icon, lambda: _say_problem(icon, controller.open_dashboard()))

    if sys.platform == "win32" and not menu_opening.install(icon):
        log.warning("tray: this pystray is not %s; the menu's readings are those of when "
                    "it was last built", menu_opening.PYSTRAY_VERSION)
    view = TrayView(controller, menu_on_open=sys.platform == "win32")
    controller.follow()
    try:
        icon.run(lambda icon: update_loop(icon, controller, stop, view))
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
