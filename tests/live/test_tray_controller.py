"""The tray controller against a real server: readings, actions, a dead server,
and supervision of a server process that crashes. No display needed."""

from __future__ import annotations

import subprocess
import sys
import webbrowser
from pathlib import Path

import pytest
from live_server import free_port

from app.cli.main import main
from tray.client import ApiClient
from tray.controller import TrayController

pytestmark = pytest.mark.slow


@pytest.fixture
def controller(server):
    messages: list[str] = []
    tray = TrayController(ApiClient(server.url, server.token_file), notify=messages.append)
    tray.messages = messages  # type: ignore[attr-defined]
    yield tray
    tray.client.close()


def test_reads_the_server_and_draws_its_state(controller):
    controller.refresh()
    assert controller.sample is not None and controller.status == "running"
    assert controller.tooltip().startswith("vramguard: healthy, ")
    assert controller.lines()[0].startswith("Used: ")
    image = controller.icon(32)
    assert image.size == (32, 32)


def test_actions_go_through_the_api(controller, server, monkeypatch):
    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: opened.append(url))
    with server.client() as client:
        before = client.get("/v1/memory").json()
    assert controller.empty_cache().startswith("Gave back ")
    assert controller.reset_peak() == "Peak reset."
    assert controller.toggle_pause() == "Paused."
    assert controller.paused
    assert controller.toggle_pause() == "Taking images again."
    assert controller.open_dashboard() is None
    assert len(opened) == 1 and opened[0].startswith("file://") and "code" not in opened[0]
    assert not controller.paused
    with server.client() as client:
        after = client.get("/v1/memory").json()
    assert after["idle_releases"] == before["idle_releases"]  # an explicit release, not idle
    assert after["cache_empties"] == before["cache_empties"] + 1


def test_the_models_in_memory_and_an_unload_the_server_refuses(controller):
    """The real server's samples list its model; unloading one that is not loaded goes
    through the real endpoint and comes back in plain words (the session's server keeps
    its one model: the unload itself is tried in test_desktop.py and test_tray_models.py)."""
    controller.refresh()
    [entry] = controller.models()
    assert entry.name == "efficientnet_lite0" and entry.label.endswith(", kept loaded")
    assert controller.unload("efficientnet_lite2") == (
        "efficientnet_lite2 was not in memory any more: there was nothing to unload.")
    assert [e.name for e in controller.models()] == ["efficientnet_lite0"]


def test_a_server_that_is_not_there(tmp_path):
    messages: list[str] = []
    tray = TrayController(ApiClient(f"http://127.0.0.1:{free_port()}", tmp_path / "token"),
                          notify=messages.append)
    tray.refresh()
    assert tray.down and tray.tooltip() == "vramguard: not running"
    assert tray.empty_cache().startswith("Could not do that")
    assert not messages


def supervising(tmp_path: Path, exit_status: int) -> tuple[TrayController,
                                                          list[subprocess.Popen[bytes]]]:
    """A tray that starts a 'server' which exits at once with this status."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn() -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen([sys.executable, "-c",
                                         f"raise SystemExit({exit_status})"]))
        return started[-1]

    tray = TrayController(ApiClient(f"http://127.0.0.1:{free_port()}", tmp_path / "token"),
                          notify=lambda _m: None, start_server=spawn)
    tray.ensure_server()
    started[0].wait(10)
    tray.refresh()
    return tray, started


def test_a_crashed_server_is_restarted_and_the_menu_says_why(tmp_path):
    tray, started = supervising(tmp_path, 1)
    assert len(started) == 2 and tray.restarts == 1
    assert any("exit status 1" in line for line in tray.lines())
    started[1].wait(10)
    tray.refresh()  # within the back-off: no restart storm
    assert len(started) == 2


def test_a_server_stopped_on_purpose_stays_down_and_ends_the_tray(tmp_path):
    tray, started = supervising(tmp_path, 0)
    assert len(started) == 1 and tray.restarts == 0
    assert tray.stopped and "Last stop: the server was asked to stop" in tray.lines()


def test_tray_without_a_display(monkeypatch, capsys):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert main(["tray"]) == 1
    assert "needs a display" in capsys.readouterr().err


def test_run_without_a_display_serves_headless(tmp_path):
    import os

    from bench.process import running

    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY") and not k.startswith("VRAMGUARD_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "c"),
               XDG_CACHE_HOME=str(tmp_path / "k"), XDG_STATE_HOME=str(tmp_path / "s"))
    command = [sys.executable, "-m", "app", "run", "--port", str(port)]
    with running(command, f"http://127.0.0.1:{port}/readyz", tmp_path / "run.log", env):
        pass
    assert "running without a tray icon" in (tmp_path / "run.log").read_text()
