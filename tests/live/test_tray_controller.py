"""The tray controller against a real server: readings, actions, the models in memory,
and `vramguard run` without a display (a dead server and supervision without one:
unit/tray/test_tray_supervisor.py). No display needed."""

from __future__ import annotations

import sys
import webbrowser

import pytest
from live_server import free_port

from tray.client import ApiClient
from tray.controller import TrayController
from tray.text import USE_PAGE_DOWN


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


def test_says_it_is_ready_once_and_opens_the_use_page(controller, server, monkeypatch):
    """The first reading of a ready server is said once, whatever follows; the use page is
    opened at the configured address (it holds no secret: no one-time code)."""
    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: opened.append(url))
    for _ in range(3):
        controller.refresh()
    port = server.url.rsplit(":", 1)[1]
    assert controller.messages == [f"vramguard is ready: 127.0.0.1:{port}"]
    assert controller.open_use_page() is None
    assert opened == [f"{server.url}/ui/use"]


def test_a_server_that_is_not_there_is_not_said_to_be_ready(tmp_path, monkeypatch):
    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: opened.append(url))
    messages: list[str] = []
    with ApiClient(f"http://127.0.0.1:{free_port()}", tmp_path / "token") as client:
        tray = TrayController(client, notify=messages.append)
        tray.refresh()
        assert tray.open_use_page() == USE_PAGE_DOWN
    assert messages == [] and opened == []


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


def test_save_a_support_report_writes_a_new_zip_each_time(controller, tmp_path):
    import zipfile

    said = [controller.save_support_report(tmp_path), controller.save_support_report(tmp_path)]
    saved = sorted(tmp_path.glob("vramguard-support-*.zip"))
    assert len(saved) == 2, said  # the second of the same second does not overwrite
    assert all(message.startswith("Saved a support report to ") for message in said)
    with zipfile.ZipFile(saved[0]) as report:
        assert "doctor.txt" in report.namelist()
        token = controller.client.token_file.read_text().strip()
        assert all(token.encode() not in report.read(name) for name in report.namelist())
    assert controller.save_support_report(tmp_path / "missing").startswith(
        "Could not save a support report: ")


def test_a_lost_graphics_card_ends_the_server_and_the_tray_starts_a_new_one(tmp_path,
                                                                              monkeypatch):
    """Issue 27, item 5: the card stops working mid-batch (torch's AcceleratorError with
    CUDA's sticky message, raised by tests/support/gpu_loss_server.py): the request gets
    a 503 that says so, the server exits with GPU_LOST instead of living on unable to
    serve, and the tray starts a new server at once, which serves."""
    import os
    import time

    import httpx
    from images import photo
    from live_server import ROOT, USER_DIRS

    from app.cli.process_control import ServerOutput
    from app.host.exit_status import GPU_LOST
    from tray.text import GPU_RESTARTED

    port = free_port()
    home = tmp_path / "home"
    env = {**{var: str(home / var.lower()) for var in USER_DIRS},
           "VRAMGUARD_TOKEN_FILE": str(home / "admin-token"), "VRAMGUARD_CACHE": "0"}
    trigger = tmp_path / "lose-the-gpu"
    command = [sys.executable, str(ROOT / "tests" / "support" / "gpu_loss_server.py"),
               str(trigger), "serve", "--port", str(port)]
    outputs: dict[int, ServerOutput] = {}

    def spawn():
        output = ServerOutput(command)
        outputs[output.process.pid] = output
        return output.process

    said: list[str] = []
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        tray.refresh()
        return tray.sample is not None

    def wait(condition, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.3)

    for name in [name for name in os.environ if name.startswith("VRAMGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():  # ServerOutput starts the server with our environment
        monkeypatch.setenv(name, value)
    with ApiClient(url, home / "admin-token") as client:
        tray = TrayController(client, notify=said.append, start_server=spawn,
                              last_words=lambda process: outputs[process.pid].why())
        tray.ensure_server()
        try:
            wait(serving, 180)
            first = tray.server
            assert first is not None
            trigger.touch()
            answer = httpx.post(f"{url}/v1/classify", content=photo(), timeout=60,
                                headers={"Content-Type": "image/jpeg"})
            assert answer.status_code == 503 and "graphics card" in answer.text
            assert first.wait(60) == GPU_LOST
            tray.refresh()
            assert tray.server is not None and tray.server is not first
            assert GPU_RESTARTED in said and tray.restarts == 0
            wait(serving, 180)
            again = httpx.post(f"{url}/v1/classify", content=photo(), timeout=60,
                               headers={"Content-Type": "image/jpeg"})
            assert again.status_code == 200, again.text
        finally:
            tray.stop_server()
