"""The tray's supervision of the server it started, with tiny stand-in server processes
(no model): what is a crash to restart, and what is a stop or a start failure to accept.
On Windows a stop that has to end the server (TerminateProcess) gives exit status 15, and
a busy port makes uvicorn exit with 3: both are mimicked here with plain exit statuses.
Also a server that is not there, and `vramguard tray` without a display."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

from live_server import free_port

from app.cli.main import main
from app.cli.process_control import ServerOutput
from app.host.instance import instance_folder, request_stop
from tray.client import ApiClient
from tray.controller import TrayController


def stand_in(exit_status: int, says: str = "", seconds: float = 0) -> list[str]:
    script = (f"import sys, time; time.sleep({seconds}); "
              f"print({says!r}, file=sys.stderr); raise SystemExit({exit_status})")
    return [sys.executable, "-c", script]


class Tray(TrayController):
    said: list[str]
    started: list[subprocess.Popen[bytes]]


def tray_for(tmp_path: Path, command: list[str]) -> Tray:
    started: list[subprocess.Popen[bytes]] = []
    said: list[str] = []
    outputs: dict[int, ServerOutput] = {}

    def spawn() -> subprocess.Popen[bytes]:
        output = ServerOutput(command)
        outputs[output.process.pid] = output
        started.append(output.process)
        return output.process

    tray = Tray(ApiClient(f"http://127.0.0.1:{free_port()}", tmp_path / "token"),
                notify=said.append, start_server=spawn,
                last_words=lambda process: outputs[process.pid].why())
    tray.said, tray.started = said, started
    return tray


def exits(tray: Tray) -> None:
    tray.started[-1].wait(20)
    tray.refresh()


def test_a_server_ended_during_stop_is_not_restarted(tmp_path):
    """`vramguard stop` had to end the server (Windows: TerminateProcess, exit 15)."""
    tray = tray_for(tmp_path, stand_in(15, seconds=1))
    tray.ensure_server()
    request_stop(instance_folder(tray.client.token_file),
                 int(tray.client.base_url.rsplit(":", 1)[1]))
    exits(tray)
    assert len(tray.started) == 1 and tray.stopped and tray.restarts == 0
    assert "Last stop: the server was asked to stop" in tray.lines()


def test_once_a_shutdown_is_requested_no_exit_status_restarts_the_server(tmp_path):
    tray = tray_for(tmp_path, stand_in(15, seconds=1))
    tray.ensure_server()
    tray.request_shutdown()
    exits(tray)
    assert len(tray.started) == 1 and tray.stopped


def test_an_earlier_stop_does_not_stop_a_later_server(tmp_path):
    tray = tray_for(tmp_path, stand_in(1))
    request_stop(instance_folder(tray.client.token_file),
                 int(tray.client.base_url.rsplit(":", 1)[1]))
    time.sleep(1.2)  # the tolerance for clock steps
    tray.ensure_server()
    exits(tray)
    assert len(tray.started) == 2 and not tray.stopped


def test_a_busy_port_is_final_and_the_tray_says_why(tmp_path):
    """uvicorn's status 3 (the port is taken): restarting cannot help."""
    port_taken = "vramguard: Port 8765 is used by another program. Pick another port."
    tray = tray_for(tmp_path, stand_in(3, port_taken))
    tray.ensure_server()
    exits(tray)
    time.sleep(1.1)  # past the first back-off
    tray.refresh()
    assert len(tray.started) == 1 and tray.server is None and not tray.stopped
    assert any("Port 8765 is used by another program" in line for line in tray.lines())
    assert any("could not start" in message for message in tray.said)


def test_a_start_failure_with_the_same_cause_twice_is_final(tmp_path):
    tray = tray_for(tmp_path, stand_in(1, "vramguard: cannot write in C:\\x"))
    tray.ensure_server()
    exits(tray)
    assert len(tray.started) == 2  # one retry: it may have been a passing problem
    exits(tray)
    time.sleep(1.1)
    tray.refresh()
    assert len(tray.started) == 2 and tray.server is None
    assert any("cannot write in" in line for line in tray.lines())


def launch(monkeypatch, tmp_path: Path, *extra: str) -> tuple[int, list[ServerOutput]]:
    """`vramguard run` with a stand-in server (it sleeps) and a stand-in tray that sends
    its own process SIGTERM, as `kill` or a session's end does, and waits to be closed.
    The launcher's log is in ``tmp_path / "logs"``."""
    from app.cli import process_control
    from app.cli.main import main
    from tray import app as tray_app

    servers: list[ServerOutput] = []

    def server(_command: list[str]) -> ServerOutput:
        servers.append(ServerOutput([sys.executable, "-c", "import time; time.sleep(60)"]))
        return servers[-1]

    def tray(controller: TrayController, log_file: Path | None) -> None:
        assert log_file is not None and log_file.parent == tmp_path / "logs"
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), \
            "SIGTERM would end the launcher and leave its server running"
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not controller.stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert controller.stopped

    monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(tmp_path / "admin-token"))
    monkeypatch.setenv("VRAMGUARD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(tray_app, "display_available", lambda: True)
    monkeypatch.setattr(tray_app, "run_tray", tray)
    monkeypatch.setattr(process_control, "ServerOutput", server)
    before = signal.getsignal(signal.SIGTERM)
    status = main(["run", "--port", str(free_port()), *extra])
    assert signal.getsignal(signal.SIGTERM) == before
    return status, servers


def test_a_launcher_ended_by_sigterm_ends_the_server_it_started(monkeypatch, tmp_path):
    status, servers = launch(monkeypatch, tmp_path)
    assert status == 0 and len(servers) == 1
    assert servers[0].process.poll() is not None


def test_the_launcher_keeps_a_log_of_its_own(monkeypatch, tmp_path):
    """Issue 27: a windowed launcher has no console; what it says, why it gave up and
    its crashes go to vramguard-tray.log beside the server's log, never to the server's."""
    launch(monkeypatch, tmp_path)
    [log] = (tmp_path / "logs").glob("vramguard-tray-*.log")  # beside the server's, its own
    text = log.read_text()
    assert "tray, log" in text and "ending on signal" in text, text


class RecordingJob:
    """ServerJob's stand-in (the real one acts on Windows only): which servers it got."""

    made: ClassVar[list[RecordingJob]] = []

    def __init__(self) -> None:
        self.pids: list[int] = []
        RecordingJob.made.append(self)

    def add(self, pid: int) -> bool:
        self.pids.append(pid)
        return True


def test_the_server_is_put_in_the_launchers_job(monkeypatch, tmp_path):
    """Issue 27, item 6: a launcher ended from Task Manager takes its server with it."""
    from app.cli import process_control

    RecordingJob.made.clear()
    monkeypatch.setattr(process_control, "ServerJob", RecordingJob)
    status, servers = launch(monkeypatch, tmp_path)
    assert status == 0 and [job.pids for job in RecordingJob.made] == [
        [servers[0].process.pid]]


def test_keep_server_leaves_the_server_running(monkeypatch, tmp_path):
    from app.cli import process_control

    RecordingJob.made.clear()
    monkeypatch.setattr(process_control, "ServerJob", RecordingJob)
    status, servers = launch(monkeypatch, tmp_path, "--keep-server")
    try:
        assert status == 0 and servers[0].process.poll() is None
        assert RecordingJob.made == []  # not in a job that would end it with the launcher
    finally:
        servers[0].process.kill()
        servers[0].process.wait()


def test_ctrl_break_is_a_clean_stop_on_windows(monkeypatch):
    """Only the choice of signals can be checked here: SIGBREAK exists only on Windows."""
    from app.cli.process_control import stop_signals

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(signal, "SIGBREAK", 21, raising=False)
    assert set(stop_signals()) == {signal.SIGINT, signal.SIGTERM, 21}


def test_the_port_check_binds_exclusively_on_windows(monkeypatch):
    """With SO_REUSEADDR, Windows lets the same user bind a port in use, so the check saw
    no problem. Only the option chosen can be checked here (the constant exists only on
    Windows); a real busy port on Windows is for the Windows workflow."""
    from app.cli import process_control

    options: list[int] = []

    class Probe:
        def __init__(self, *args: object) -> None:
            pass

        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *exc_info: object) -> None:
            pass

        def setsockopt(self, level: int, option: int, value: int) -> None:
            options.append(option)

        def bind(self, address: tuple[str, int]) -> None:
            raise OSError(10048, "in use")  # WSAEADDRINUSE

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(socket, "SO_EXCLUSIVEADDRUSE", -5, raising=False)
    monkeypatch.setattr(errno, "WSAEADDRINUSE", 10048, raising=False)
    monkeypatch.setattr(process_control.socket, "socket", Probe)
    problem = process_control._port_problem("127.0.0.1", 8765)
    assert options == [-5]
    assert problem is not None and "Port 8765 is used by another program" in problem


def test_a_starting_server_is_shown_as_starting(tmp_path):
    tray = tray_for(tmp_path, stand_in(0, seconds=30))
    tray.ensure_server()
    try:
        tray.refresh()
        assert tray.lines()[0] == "Starting (first start can take a few minutes)"
        assert tray.tooltip() == "vramguard: starting (first start can take a few minutes)"
    finally:
        tray.started[0].kill()
        tray.started[0].wait()


def test_the_dashboard_says_the_same_while_starting():
    """Before its first reading, and while /readyz answers 503 (warming up). A text check:
    the browser tests (test_dashboard.py) run against a server that is already warm."""
    from live_server import ROOT

    from tray.controller import STARTING

    page = (ROOT / "app" / "ui" / "dashboard.html").read_text()
    assert page.count(STARTING) == 2 and 'fetch("/readyz")' in page


def test_a_tray_ended_by_the_stop_command_leaves_the_server_to_it(tmp_path):
    """A second stop request or a signal while the server drains would cut the drain
    short (uvicorn's forced exit): the tray only waits for it to end."""
    tray = tray_for(tmp_path, stand_in(0, seconds=2))
    tray.ensure_server()
    request_stop(instance_folder(tray.client.token_file),
                 int(tray.client.base_url.rsplit(":", 1)[1]))
    tray.stop_server()
    assert tray.started[0].returncode == 0  # ended by itself, not by SIGTERM (-15)


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


def test_a_second_launch_during_the_first_start_starts_nothing(monkeypatch, tmp_path,
                                                               capsys):
    """Issue 27, item 4: while another `vramguard run` holds the launcher lock (its server
    still importing torch, so no server lock yet), a second launch starts no server and
    leaves the first a note to say so."""
    from app.cli import process_control
    from app.host.launcher_lock import LauncherLock
    from tray import app as tray_app
    from tray.text import STILL_STARTING

    port = free_port()
    folder = instance_folder(tmp_path / "admin-token")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from pathlib import Path; "
         "from app.host.launcher_lock import LauncherLock; "
         f"assert LauncherLock(Path({str(folder)!r}), {port}).acquire(); "
         "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    spawned: list[list[str]] = []
    monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(tmp_path / "admin-token"))
    monkeypatch.setenv("VRAMGUARD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(tray_app, "display_available", lambda: True)
    monkeypatch.setattr(process_control, "ServerOutput",
                        lambda command: spawned.append(command))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main(["run", "--port", str(port)]) == 0
    finally:
        holder.kill()
        holder.wait()
    assert spawned == []
    assert STILL_STARTING in capsys.readouterr().err
    lock = LauncherLock(folder, port)
    deadline = time.monotonic() + 5
    while not lock.acquire():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not lock.launched_again()  # a note for the ended launcher is not the next one's
    lock.release()


def test_the_tray_says_it_is_starting_at_once_and_answers_a_second_launch(tmp_path):
    from tray.text import STARTING_NOTICE, STILL_STARTING

    again = [False, True, False]
    tray = tray_for(tmp_path, stand_in(0, seconds=30))
    tray.launched_again = lambda: again.pop(0)
    tray.ensure_server()
    try:
        for _ in range(3):
            tray.refresh()
        assert tray.said == [STARTING_NOTICE, STILL_STARTING]
    finally:
        tray.started[-1].kill()
        tray.started[-1].wait()


def test_a_lost_graphics_card_restarts_the_server_once_not_as_a_crash(tmp_path):
    """Issue 27, item 5: a server that left with GPU_LOST (its CUDA context broken by a
    driver reset) is started again at once, said in a notification, counted neither as a
    crash nor as a start failure; a second loss is a crash like any other."""
    from app.host.exit_status import GPU_LOST
    from tray.text import GPU_RESTARTED

    tray = tray_for(tmp_path, stand_in(GPU_LOST, "vramguard: the graphics card stopped"))
    tray.ensure_server()
    exits(tray)
    assert len(tray.started) == 2 and tray.restarts == 0
    assert GPU_RESTARTED in tray.said
    assert any("graphics card" in line for line in tray.lines())
    exits(tray)
    assert len(tray.started) == 3 and tray.restarts == 1  # the second: a crash, backed off
    assert tray.said.count(GPU_RESTARTED) == 1
    tray.started[-1].wait(20)
