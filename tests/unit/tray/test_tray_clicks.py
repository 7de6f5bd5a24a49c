"""A click on an icon without a menu (pystray's xorg backend): which presses are a click, a
double click that opens one dashboard, an action that fails without ending anything; and
what the tray says where the backend shows no notifications. The xorg backend itself
needs an X display: desktop/test_desktop.py clicks the real icon."""

from __future__ import annotations

import threading

import pytest

from tray.app import _say, load_pystray
from tray.clicks import REPEAT_MS, ClickHandler, accept_clicks


class Counted:
    """An action that counts its runs and can be waited for."""

    def __init__(self, fail: bool = False) -> None:
        self.runs = 0
        self.fail = fail
        self.ran = threading.Event()

    def __call__(self) -> None:
        self.runs += 1
        self.ran.set()
        if self.fail:
            raise RuntimeError("the browser could not be started")


def test_a_left_or_right_click_runs_the_action_and_a_double_click_runs_it_once():
    action = Counted()
    clicks = ClickHandler(action)
    assert clicks.press(1, 10_000)
    assert action.ran.wait(5)
    assert not clicks.press(1, 10_000 + 150)  # the second press of a double click
    assert not clicks.press(2, 20_000)  # the middle button
    assert not clicks.press(4, 20_000) and not clicks.press(5, 20_000)  # the wheel
    action.ran.clear()
    assert clicks.press(3, 10_000 + REPEAT_MS)  # a right click, a second later
    assert action.ran.wait(5)
    assert action.runs == 2


def test_a_failing_action_is_logged_and_the_next_click_works(caplog):
    action = Counted(fail=True)
    clicks = ClickHandler(action)
    with caplog.at_level("ERROR", logger="vramguard.tray"):
        assert clicks.press(1, 0)
        assert action.ran.wait(5)
        for thread in threading.enumerate():
            if thread.name == "tray-click":
                thread.join(5)
    assert "a click on the icon failed" in caplog.text
    assert "the browser could not be started" in caplog.text
    action.ran.clear()
    assert clicks.press(1, 5_000) and action.ran.wait(5)


class Icon:
    """pystray's icon as far as notifications go."""

    def __init__(self, has_notification: bool, refuse: bool = False) -> None:
        self.HAS_NOTIFICATION = has_notification
        self.refuse = refuse
        self.said: list[str] = []

    def notify(self, message: str, _title: str = "") -> None:
        if self.refuse:  # GTK's, where no notification service runs
            raise RuntimeError("The name org.freedesktop.Notifications was not provided")
        self.said.append(message)


def test_a_notification_is_shown_where_it_can_be_and_logged_where_not(caplog):
    shown = Icon(has_notification=True)
    _say(shown, "vramguard is ready: 127.0.0.1:8765")
    assert shown.said == ["vramguard is ready: 127.0.0.1:8765"]
    with caplog.at_level("WARNING", logger="vramguard.tray"):
        _say(Icon(has_notification=False), "vramguard is ready: 127.0.0.1:8765")
        _say(Icon(has_notification=True, refuse=True), "GPU memory is full")
    assert "tray: vramguard is ready: 127.0.0.1:8765" in caplog.text
    assert "GPU memory is full (could not show it as a notification" in caplog.text


@pytest.fixture
def pystray(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYSTRAY_BACKEND", "dummy")
    return load_pystray()


def test_a_backend_with_a_menu_is_left_alone(pystray):
    icon = pystray.Icon("vramguard", None, "vramguard")
    assert icon.HAS_MENU and accept_clicks(icon, Counted()) is None

