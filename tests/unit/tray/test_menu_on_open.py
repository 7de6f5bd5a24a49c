"""Issue 27, item 2: on Windows the menu is built on the icon's message thread as it
opens, never from the update loop. pystray's win32 backend runs only on Windows, so a
stand-in backend with the same private parts (a message loop that dispatches through
``_message_handlers``, ``_update_menu`` building the native menu) records which thread
built each menu; and pystray 0.19.5's own source is read for each part the wrapper uses."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import queue
import threading
import time
from pathlib import Path

from PIL import Image

from tray import menu_on_open
from tray.app import TrayView, update_loop


class LiveController:
    """Readings that change at every refresh, as a GPU's do every second."""

    def __init__(self, refreshes: int) -> None:
        self.reading = 0
        self.left = refreshes
        self.down = self.paused = self.stopped = False
        self.start_server = None

    def icon(self, size: int = 64) -> Image.Image:
        return Image.new("RGB", (size, size), "green")

    def tooltip(self) -> str:
        return "vramguard: healthy"

    def lines(self) -> list[str]:
        return [f"Used: {self.reading} MiB"]

    def models(self) -> list[object]:
        return []

    def refresh(self) -> None:
        self.reading += 1
        self.left -= 1
        self.stopped = self.left <= 0

    def wait_for_news(self, timeout_s: float) -> bool:
        time.sleep(0.002)
        return False


class Win32StandIn:
    """pystray's win32 Icon as far as the menu goes: its message loop on a thread of its
    own calls ``_message_handlers[message](wparam, lparam)``; ``_update_menu`` destroys
    the menu and builds a new one (recording the thread); a right-button release on the
    icon opens the last-built menu."""

    def __init__(self, controller: LiveController) -> None:
        self.controller = controller
        self.builds: list[str] = []  # the thread of each build
        self.shown: list[str] = []  # each menu opened
        self._menu: str | None = None
        self._message_handlers = {menu_on_open.WM_NOTIFY: self._on_notify}
        self.messages: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self.loop = threading.Thread(target=self._mainloop, name="message-loop")
        self.icon: Image.Image | None = None
        self.title = ""
        self.visible = False

    def _mainloop(self) -> None:
        self._update_menu()  # pystray's _mark_ready, on the message thread
        while (message := self.messages.get()) is not None:
            self._message_handlers.get(message[0], lambda wparam, lparam: 0)(0, message[1])

    def _update_menu(self) -> None:
        self.builds.append(threading.current_thread().name)
        self._menu = self.controller.lines()[0]

    def update_menu(self) -> None:  # pystray's public one: _update_menu, on the caller
        self._update_menu()

    def _on_notify(self, wparam: int, lparam: int) -> None:
        if self._menu and lparam == menu_on_open.WM_RBUTTONUP:
            self.shown.append(self._menu)

    def stop(self) -> None:
        self.messages.put(None)


def run(wrapped: bool) -> Win32StandIn:
    """The real update loop on its thread and right-clicks on the message thread."""
    controller = LiveController(refreshes=200)
    icon = Win32StandIn(controller)
    if wrapped:
        assert menu_on_open.install(icon)
    view = TrayView(controller, menu_on_open=wrapped)  # type: ignore[arg-type]
    icon.loop.start()
    updates = threading.Thread(target=update_loop, name="update-loop",
                               args=(icon, controller, threading.Event(), view))
    updates.start()
    while updates.is_alive():
        icon.messages.put((menu_on_open.WM_NOTIFY, menu_on_open.WM_RBUTTONUP))
        time.sleep(0.01)
    updates.join()
    icon.loop.join(10)
    return icon


def test_every_menu_is_built_on_the_message_thread_as_it_opens():
    icon = run(wrapped=True)
    assert icon.shown and set(icon.builds) == {"message-loop"}
    assert len(icon.builds) == len(icon.shown) + 1  # one at start, one as each opens


def test_without_it_the_update_loop_rebuilds_the_menu_under_the_open_one():
    """What the wrapper removes: pystray's update_menu on the update thread."""
    icon = run(wrapped=False)
    assert "update-loop" in icon.builds


def test_an_icon_without_those_parts_is_left_alone():
    class Gtk:
        def _update_menu(self) -> None:
            pass

    assert not menu_on_open.install(Gtk())
    assert not menu_on_open.install(object())


def _pystray_file(name: str) -> Path:
    spec = importlib.util.find_spec("pystray")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / name


def test_written_for_the_pinned_pystray_and_its_private_parts_are_there():
    """The wrapper's assumptions, read from pystray's win32 source (it cannot be imported
    off Windows): the version, the two message numbers, the handler table built in
    __init__ with WM_NOTIFY -> _on_notify, _on_notify opening _menu_handle on
    WM_RBUTTONUP, and _update_menu making _menu_handle."""
    assert importlib.metadata.version("pystray") == menu_on_open.PYSTRAY_VERSION
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    assert f'"pystray=={menu_on_open.PYSTRAY_VERSION}"' in pyproject.read_text()
    constants = {}
    for node in ast.parse(_pystray_file("_util/win32.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            constants[node.targets[0].id] = ast.unparse(node.value)
    assert int(constants["WM_USER"], 0) == menu_on_open.WM_USER
    assert constants["WM_NOTIFY"] == "WM_USER + 11"
    assert int(constants["WM_RBUTTONUP"], 0) == menu_on_open.WM_RBUTTONUP
    source = _pystray_file("_win32.py").read_text()
    icon = next(node for node in ast.parse(source).body
                if isinstance(node, ast.ClassDef) and node.name == "Icon")
    methods = {node.name: ast.unparse(node) for node in icon.body
               if isinstance(node, ast.FunctionDef)}
    assert "self._message_handlers = {" in methods["__init__"]
    assert "win32.WM_NOTIFY: self._on_notify" in methods["__init__"]
    assert "lparam == win32.WM_RBUTTONUP" in methods["_on_notify"]
    assert "self._menu_handle" in methods["_on_notify"]
    assert "self._menu_handle = (hmenu, callbacks)" in methods["_update_menu"]
    assert "icon._message_handlers.get(" in source  # the window procedure dispatches so
