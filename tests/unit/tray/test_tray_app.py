"""The tray's mapping onto pystray, without a display: what is handed to pystray and
when, a failing update that must not freeze the tray, the default action, and the
choice of backend. pystray's win32 backend (its temporary .ico files, its menu rebuilt
from another thread) only runs on Windows: here a stand-in icon records the calls."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from live_server import ROOT
from PIL import Image

from tray.app import TrayView, build_menu, update_loop


class Controller:
    """What the tray reads from TrayController, set by hand."""

    def __init__(self) -> None:
        self.colour = "green"
        self.lines_shown = ["Used: 1 GiB"]
        self.down = False
        self.paused = False
        self.stopped = False
        self.start_server = None
        self.refreshes = 0

    def icon(self, size: int = 64) -> Image.Image:
        return Image.new("RGB", (size, size), self.colour)

    def tooltip(self) -> str:
        return f"vramguard: {self.colour}"

    def lines(self) -> list[str]:
        return self.lines_shown

    def models(self) -> list[object]:
        return []

    def refresh(self) -> None:
        self.refreshes += 1

    def wait_for_news(self, timeout_s: float) -> bool:
        if self.refreshes >= 2:
            self.stopped = True
        return False


class Icon:
    """pystray's icon, recording what it was given."""

    def __init__(self) -> None:
        self.pictures = 0
        self.titles = 0
        self.menus = 0
        self.visible = False
        self.stopped = False
        self.fail_pictures = 0
        self._icon: Image.Image | None = None

    @property
    def icon(self) -> Image.Image | None:
        return self._icon

    @icon.setter
    def icon(self, picture: Image.Image) -> None:
        if self.fail_pictures:  # pystray re-raises a refused delete of its temporary .ico
            self.fail_pictures -= 1
            raise PermissionError("the .ico is held by another program")
        self.pictures += 1
        self._icon = picture

    @property
    def title(self) -> str:
        return ""

    @title.setter
    def title(self, _text: str) -> None:
        self.titles += 1

    def update_menu(self) -> None:
        self.menus += 1

    def stop(self) -> None:
        self.stopped = True


def test_only_what_changed_is_handed_to_pystray():
    controller, icon = Controller(), Icon()
    view = TrayView(controller)  # type: ignore[arg-type]
    for _ in range(3):
        view.show(icon)
    assert (icon.pictures, icon.titles, icon.menus) == (1, 1, 1)
    controller.lines_shown = ["Used: 2 GiB"]
    view.show(icon)
    assert (icon.pictures, icon.titles, icon.menus) == (1, 1, 2)
    controller.colour = "red"
    view.show(icon)
    assert (icon.pictures, icon.titles, icon.menus) == (2, 2, 2)


def test_a_failed_update_is_logged_and_tried_again(caplog):
    controller, icon = Controller(), Icon()
    icon.fail_pictures = 1
    update_loop(icon, controller, threading.Event(), TrayView(controller))  # type: ignore
    assert icon.pictures == 1 and icon.stopped  # the picture was set again, then Quit
    assert "could not update the icon" in caplog.text


def test_open_dashboard_is_the_default_action_and_use_it_from_your_app_follows(monkeypatch):
    monkeypatch.setenv("PYSTRAY_BACKEND", "dummy")
    from tray.app import load_pystray

    pystray = load_pystray()
    menu = build_menu(pystray, Controller(), threading.Event())  # type: ignore[arg-type]
    defaults = [item.text for item in menu.items if item.default]
    assert defaults == ["Open dashboard"]
    texts = [item.text for item in menu.items]
    assert texts.index("Use it from your app") == texts.index("Open dashboard") + 1


def test_each_backend_is_tried_in_turn_when_none_is_chosen():
    """The default path (PYSTRAY_BACKEND unset) on a Linux without the AppIndicator
    typelibs: pystray's own choice raises ValueError there. No display here, so no
    backend can work: each is tried and logged, and the error says so plainly."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSTRAY_BACKEND", "DISPLAY", "WAYLAND_DISPLAY")}
    script = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              "from tray.app import load_pystray\n"
              "try:\n    load_pystray()\nexcept RuntimeError as exc:\n    print('ERROR', exc)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    tried = [name for name in ("appindicator", "gtk", "xorg") if f"the {name} backend" in out]
    assert tried == ["appindicator", "gtk", "xorg"], out
    assert "ERROR no way to show a tray icon" in out


def test_an_exception_no_one_caught_is_logged_and_notified(monkeypatch, caplog):
    """A windowed program has no console: a thread's exception would vanish."""
    import sys
    import threading

    from tray.app import report_crashes

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    said: list[str] = []
    report_crashes(said.append, Path("/home/me/.local/state/vramguard/vramguard-tray.log"))

    def broken() -> None:
        raise ValueError("a bug in a tray thread")

    with caplog.at_level("ERROR", logger="vramguard.tray"):
        worker = threading.Thread(target=broken)
        worker.start()
        worker.join(5)
    assert said == ["vramguard hit an unexpected problem (ValueError) and carried on. The "
                    "details are in /home/me/.local/state/vramguard/vramguard-tray.log."]
    assert "a bug in a tray thread" in caplog.text and "Traceback" in caplog.text


def test_the_windowed_program_logs_an_escaping_exception_instead_of_a_dialog(
        monkeypatch, caplog):
    import app.cli.main

    def broken(argv: list[str] | None = None) -> int:
        raise RuntimeError("a bug before the tray started")

    monkeypatch.setattr(app.cli.main, "main", broken)
    with caplog.at_level("ERROR", logger="vramguard"):
        assert app.cli.main.windowed_main([]) == 1
    assert "a bug before the tray started" in caplog.text and "Traceback" in caplog.text


class WindowsLikeIcon:
    """pystray's win32 notify as it behaves: the text goes into a 256-character field
    (``szInfo``, with its terminator) and the title into a 64-character one; longer ones
    raise ValueError and nothing is shown."""

    HAS_NOTIFICATION = True

    def __init__(self) -> None:
        self.shown: list[str] = []

    def notify(self, message: str, title: str) -> None:
        if len(message) > 255 or len(title) > 63:
            raise ValueError("string too long")
        self.shown.append(message)


def every_tray_message() -> list[str]:
    """Each message the tray can show, its placeholders filled long: the constants of the
    tray's modules, the crash notice, and the longest start failure (a reserved port)."""
    import errno as errno_module
    import socket

    import tray.app
    import tray.controller
    import tray.text
    from app.cli import process_control

    fillers = {"path": "C:\\Users\\a.person.with.a.long.name\\Documents\\" + "x" * 60,
               "name": "my-own-model-with-a-long-name-" + "y" * 34, "address": "[::1]:8765",
               "size": "1023.9 MiB", "kind": "UnicodeDecodeError", "where": "C:\\" + "z" * 120}
    messages = []
    for module in (tray.text, tray.controller, tray.app):
        for name, value in vars(module).items():
            if name.isupper() and isinstance(value, str) and " " in value:
                messages.append(value.format(**fillers))

    class Reserved:
        def __init__(self, *args: object) -> None:
            pass

        def __enter__(self) -> Reserved:
            return self

        def __exit__(self, *args: object) -> None:
            pass

        def setsockopt(self, *args: object) -> None:
            pass

        def bind(self, address: object) -> None:
            raise OSError(errno_module.EACCES, "An attempt was made to access a socket in "
                          "a way forbidden by its access permissions")

    real = process_control.socket.socket
    process_control.socket.socket = Reserved  # type: ignore[misc, assignment]
    try:
        reserved = process_control._port_problem("127.0.0.1", 8765)
    finally:
        process_control.socket.socket = real  # type: ignore[misc]
    assert reserved is not None and len(reserved) > 300  # the message of the issue
    messages.append(f"vramguard could not start: {reserved}")
    assert socket.socket is real
    return messages


def test_every_notification_fits_what_windows_shows(caplog):
    """Issue 27: the reserved-port message (about 385 characters) raised ValueError in
    pystray and never showed. Every message is cut at a word to fit; the log keeps it
    whole."""
    from tray.app import _say

    messages = every_tray_message()
    assert len(messages) >= 10
    icon = WindowsLikeIcon()
    with caplog.at_level("INFO", logger="vramguard.tray"):
        for message in messages:
            _say(icon, message)
    assert len(icon.shown) == len(messages)
    for message, shown in zip(messages, icon.shown, strict=True):
        assert shown == message or (shown.endswith("…") and
                                    message.startswith(shown[:-1]) and len(shown) > 200)
    assert any(shown.endswith("…") for shown in icon.shown)
    assert all(message in caplog.text for message in messages)
