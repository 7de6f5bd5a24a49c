"""Process control: run the server (``serve``), start it with its tray (``run``, ``tray``),
and stop running ones (``stop``). The command line (``app.cli``) calls these."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import psutil
import uvicorn

from app import __version__
from app.config import (
    LOOPBACK_HOSTS,
    ConfigError,
    Settings,
    default_config_file,
    unknown_variables,
)
from app.host.address import local_url
from app.host.exit_status import GPU_LOST, STARTUP_FAILURE
from app.host.instance import (
    InstanceLock,
    RunningInstance,
    instance_folder,
    is_held,
    request_stop,
    running_instance,
    running_instances,
    same_process,
)
from app.host.launcher_lock import LauncherLock, leave_note
from app.host.server_job import ServerJob

SHUTDOWN_MARGIN_S = 5  # after the last deadline: decoding and a batch still running
STOP_GRACE_S = 10  # after the stop request is answered, or for a tray to follow its server
STARTING_WAIT_S = 15  # a second launch waits this long for a server still starting
LAUNCHER_GRACE_S = 5.0  # after its server has gone, for the tray to quit by itself


def _url(settings: Settings) -> str:
    return local_url(settings.host, settings.port)


def _already_running(settings: Settings) -> RunningInstance | None:
    instance = running_instance(instance_folder(settings.token_file), settings.port)
    if instance is not None:
        pid = f" (process {instance.pid})" if instance.pid else ""
        print(f"vramguard is already running at {instance.url}{pid}; nothing else to start. "
              f"Its dashboard: {instance.url}/ui. To run a second one, give it another "
              "port: --port N.", file=sys.stderr)
    return instance


class ServerOutput:
    """A server started by the tray, its stderr passed on to ours (a windowed program
    has none) and its last lines kept: they say why a start failed, which the tray shows
    and compares with the previous failure's."""

    LOG_PREFIX = re.compile(r"^\S+ \S+ [A-Z]+ \S+: ")  # time, level, logger (app.logs)

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE)
        self._tail: deque[str] = deque(maxlen=20)
        self._reader = threading.Thread(target=self._relay, name="server-stderr",
                                        daemon=True)
        self._reader.start()

    def _relay(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode("utf-8", "replace")
            if sys.stderr is not None:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(line)
            if line.strip():
                self._tail.append(line.strip())

    def why(self) -> str:
        """Why the ended process stopped, in its own words ("" when it said nothing):
        its last `vramguard: ...` message, else its last line without the log's time."""
        self._reader.join(2)  # the last lines may still be in the pipe
        lines = list(self._tail)
        ours = [line.removeprefix("vramguard: ") for line in lines
                if line.startswith("vramguard: ")]
        if ours:
            return ours[-1]
        return self.LOG_PREFIX.sub("", lines[-1]) if lines else ""


def _port_problem(host: str, port: int) -> str | None:
    """Say why the port cannot be used, before the model spends seconds loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # Elsewhere SO_REUSEADDR only skips TIME_WAIT leftovers. On Windows it lets this
        # user bind a port another program is listening on, which would hide a busy port:
        # there, an exclusive bind fails whenever anyone holds the port.
        if sys.platform == "win32":
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
        else:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", -1)):
                return (f"Port {port} is used by another program. Pick another port with "
                        f"--port N, VRAMGUARD_PORT=N or 'port = N' in {default_config_file()}.")
            return (f"Cannot listen on {host}:{port}: {exc.strerror}. Windows reserves "
                    "some port ranges for itself (see 'netsh interface ipv4 show "
                    "excludedportrange protocol=tcp'); pick a port outside them with "
                    f"--port N, VRAMGUARD_PORT=N or 'port = N' in {default_config_file()}.")
    return None


def serve(settings: Settings, launched_by: int | None = None) -> int:
    from app.engine.device import DeviceError, resolve_device
    from app.gates.upload_deadline import UploadPace
    from app.host.logs import flush_repeats, setup_logging
    from app.host.user_files import check_user_files, reason
    from app.http.connection_share import trusted_caller
    from app.http.connections import connection_limits, guarded_protocol, listening_socket
    from app.http.server import create_app
    from app.models import ModelLoadError, resolve_weights
    from app.models.own.store import OwnModels

    if settings.host not in LOOPBACK_HOSTS:
        if not settings.allow_remote:
            print(f"vramguard: refusing to listen on {settings.host}: other computers could "
                  "reach the appliance. Add --allow-remote (VRAMGUARD_ALLOW_REMOTE=1) if that "
                  "is what you want, and list the names they use in allowed_hosts.",
                  file=sys.stderr)
            return 1
        print(f"vramguard: WARNING: listening on {settings.host}: other computers on the "
              "network can reach this appliance.", file=sys.stderr)
    try:
        resolve_device(settings.device)
        # One of your models is checked as it loads (its trial, once per content).
        if settings.weights is not None or OwnModels(settings.models_dir).get(
                settings.model) is None:
            resolve_weights(settings.model, settings.weights)
    except (DeviceError, ModelLoadError) as exc:
        print(f"vramguard: {exc}", file=sys.stderr)
        return 1
    files = check_user_files(settings.token_file, settings.log_dir,
                             settings.cache_dir if settings.cache else None)
    if files.fatal:
        print(f"vramguard: {files.fatal}", file=sys.stderr)
        return 1
    for warning in files.warnings:
        print(f"vramguard: {warning}", file=sys.stderr)
    if not files.cache_ok:
        settings = settings.model_copy(update={"cache": False})
    lock = InstanceLock(instance_folder(settings.token_file), settings.port)
    try:
        acquired = lock.acquire(_url(settings), launched_by)
    except OSError as exc:
        print(f"vramguard: cannot write in {lock.folder}: {reason(exc)}. Then start "
              "vramguard again.", file=sys.stderr)
        return 1
    if not acquired:
        if _already_running(settings) is None:
            print("vramguard: another vramguard is starting on this port; try again in a "
                  "moment.", file=sys.stderr)
            return 1
        return 0
    problem = _port_problem(settings.host, settings.port)
    if problem:
        lock.release()
        print(f"vramguard: {problem}", file=sys.stderr)
        return 1
    log_file = setup_logging(settings.log_level, settings.log_dir if files.log_ok else None,
                             settings.port)
    logging.getLogger("vramguard").info("vramguard %s starting; log file %s", __version__,
                                        log_file or "none (its folder cannot be written)")
    for warning in unknown_variables(os.environ):  # once, in the log and on stderr
        logging.getLogger("vramguard").warning(warning)
    limits = connection_limits(settings.max_connections, settings.header_timeout_s,
                               UploadPace(int(settings.min_upload_bytes_per_s),
                                          settings.upload_grace_s),
                               int(settings.max_body_bytes))
    try:
        listener = listening_socket(settings.host, settings.port)
    except OSError as exc:  # taken since the check above
        lock.release()
        print(f"vramguard: {_port_problem(settings.host, settings.port) or exc}",
              file=sys.stderr)
        return 1
    # uvicorn drains and stops on SIGINT/SIGTERM (and Ctrl+Break's SIGBREAK on Windows),
    # then re-raises the signal; this handler turns that into a normal exit (status 0)
    # instead of death by signal.
    for stop_signal in stop_signals():
        signal.signal(stop_signal, _exit_cleanly)
    try:
        app = create_app(settings)
    except ConfigError as exc:  # an API key file that cannot be used
        listener.close()
        lock.release()
        print(f"vramguard: {exc}", file=sys.stderr)
        return 1
    # A graceful shutdown lets every queued request reach its own deadline (an answer,
    # if only a 503) before uvicorn cancels what is left: cancelled requests get a 500.
    graceful_s = int(settings.request_timeout_s + SHUTDOWN_MARGIN_S)
    # No proxy headers: nothing sits in front of vramguard, and honouring X-Forwarded-For
    # from 127.0.0.1 would let any local program pick the address its rate limit counts.
    # One access-log line per request only when debugging: a flood would otherwise write
    # thousands a second and rotate the useful log away (/v1/stats counts them instead).
    # The asyncio loop always, never uvloop (which the cluster extra brings along): the
    # connection limits in app/http/connections.py are built and tested on asyncio's transports.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, workers=1,
                            loop="asyncio",
                            log_level=settings.log_level, timeout_graceful_shutdown=graceful_s,
                            timeout_keep_alive=settings.idle_timeout_s, proxy_headers=False,
                            access_log=settings.log_level == "debug",
                            http=guarded_protocol(limits, app.state.vg.stats,
                                                  trusted_caller(app.state.vg)),
                            log_config=None)
    server = _Server(config, on_exit=app.state.vg.feed.close)
    app.state.vg.on_gpu_lost = server.leave
    try:
        server.run(sockets=[listener])
    finally:
        lock.release()
        flush_repeats()
    if app.state.vg.engine.health.device_lost:
        return GPU_LOST
    return 0 if server.started else STARTUP_FAILURE


class _Server(uvicorn.Server):
    """uvicorn's server, calling `on_exit` (on the event loop) as soon as shutdown begins
    rather than after open connections have ended (event streams never end by
    themselves)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        with contextlib.suppress(RuntimeError):  # no loop running: nothing to end
            asyncio.get_running_loop().call_soon_threadsafe(self.on_exit)

    def leave(self) -> None:
        """Shut down as on a stop signal, on the event loop, without one: uvicorn would
        re-raise a signal at the end, and the exit status must say why it left."""
        self.should_exit = True
        self.on_exit()


def stop_signals() -> tuple[int, ...]:
    """The signals that ask for a clean stop: Ctrl+C, SIGTERM, and on Windows Ctrl+Break
    (SIGBREAK), which a console sends to every vramguard process in it."""
    found = [signal.SIGINT, signal.SIGTERM]
    if sys.platform == "win32":
        found.append(signal.SIGBREAK)
    return tuple(found)


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _tray_logging(settings: Settings) -> Path | None:
    """The launcher's own rotating log (``vramguard-tray.log`` beside the server's): a
    windowed launcher has no console, and its messages, why it gave up and a crash's
    traceback would be lost. None when the folder cannot be written (said on stderr)."""
    from app.host.logs import setup_logging
    from app.host.user_files import check_user_files

    files = check_user_files(settings.token_file, settings.log_dir, None)
    log_file = setup_logging(settings.log_level, settings.log_dir if files.log_ok else None,
                             settings.port, part="tray")
    logging.getLogger("vramguard.tray").info("vramguard %s tray, log %s", __version__,
                                             log_file or "none (its folder cannot be written)")
    return log_file


def tray_command(settings: Settings, start_server: bool, argv: list[str] | None,
                 keep_server: bool = False) -> int:
    """`tray`: icon for a running server. `run`: start the server as a child and show the
    icon (Ollama-style); without a display `run` is the same as `serve`. The server `run`
    started ends with it (Quit, Ctrl+C, Ctrl+Break, SIGTERM) unless `keep_server`.
    `run` takes the launcher lock first, before anything slow (app/host/launcher_lock.py)."""
    if not start_server:
        return _tray(settings, start_server, argv, keep_server, None)
    from app.host.user_files import reason
    from tray.text import STILL_STARTING

    folder = instance_folder(settings.token_file)
    lock = LauncherLock(folder, settings.port)
    try:
        acquired = lock.acquire()
    except OSError as exc:
        print(f"vramguard: cannot write in {folder}: {reason(exc)}. Then start vramguard "
              "again.", file=sys.stderr)
        return 1
    if not acquired:  # a second double-click while the first launch is under way
        if _already_running(settings):
            return _show_dashboard(settings, _url(settings))
        with contextlib.suppress(OSError):
            leave_note(folder, settings.port)
        print(f"vramguard: {STILL_STARTING}", file=sys.stderr)
        return 0
    try:
        return _tray(settings, start_server, argv, keep_server, lock)
    finally:
        lock.release()


def _tray(settings: Settings, start_server: bool, argv: list[str] | None,
          keep_server: bool, lock: LauncherLock | None) -> int:
    from tray import app as tray_app

    if not tray_app.display_available():
        if start_server:
            print("vramguard: no display, running without a tray icon.", file=sys.stderr)
            return serve(settings)
        print("vramguard: the tray needs a display (none found).", file=sys.stderr)
        return 1
    from tray.client import ApiClient
    from tray.controller import TrayController

    log_file = _tray_logging(settings)
    url = _url(settings)
    if start_server and _already_running(settings):
        return _show_dashboard(settings, url)  # a second double-click on the shortcut
    server_args = [arg for arg in (argv or sys.argv[1:]) if arg != "--keep-server"]
    if start_server:  # the child gets the same options, as `serve`
        server_args[server_args.index("run")] = "serve"

    outputs: dict[int, ServerOutput] = {}
    job = None if keep_server else ServerJob()  # the server ends with us, even if killed

    def spawn() -> subprocess.Popen[bytes]:
        command = [sys.executable, *([] if getattr(sys, "frozen", False) else ["-m", "app"]),
                   *server_args, "--launched-by", str(os.getpid())]
        output = ServerOutput(command)
        outputs[output.process.pid] = output
        if job is not None:
            job.add(output.process.pid)
        return output.process

    with ApiClient(url, settings.token_file) as client:
        controller = TrayController(client, notify=print,
                                    start_server=spawn if start_server else None,
                                    last_words=lambda process: outputs[process.pid].why(),
                                    launched_again=lock.launched_again if lock else None)

        def end_tray(signum: int, frame: object) -> None:
            """Leave the tray; the server this launcher started ends with it (below)."""
            logging.getLogger("vramguard.tray").info("ending on signal %d", signum)
            controller.request_shutdown()
            controller.stopped = True  # the tray's update loop closes the icon
            controller.stop_following()

        previous = {number: signal.signal(number, end_tray) for number in stop_signals()}
        try:
            controller.ensure_server()
            tray_app.run_tray(controller, log_file)
        finally:
            if keep_server:
                controller.request_shutdown()
            else:
                controller.stop_server()
            for number, handler in previous.items():
                signal.signal(number, handler)
    return 0


def _show_dashboard(settings: Settings, url: str) -> int:
    """Open the running server's dashboard (waiting a little for one still starting);
    nothing is opened, and nothing sent, when another program answers on the port."""
    from tray.client import ApiClient, NotVramguard, ServerDown
    from tray.dashboard import DashboardOpener

    deadline = time.monotonic() + STARTING_WAIT_S
    with ApiClient(url, settings.token_file) as client:
        opener = DashboardOpener(client, instance_folder(settings.token_file))
        while True:
            try:
                opener.open()
                return 0
            except ServerDown as exc:
                if time.monotonic() >= deadline:
                    problem = f"vramguard on port {settings.port} does not answer ({exc})."
                    break
                time.sleep(0.5)
            except (NotVramguard, RuntimeError) as exc:
                problem = str(exc)
                break
    print(f"vramguard: could not open the dashboard. {problem}", file=sys.stderr)
    return 1


def _gone(process: psutil.Process | None) -> bool:
    """Whether a process has ended (a zombie has: only its parent's bookkeeping is left);
    True for None, a process nobody could name."""
    if process is None:
        return True
    try:  # is_running() is False as well once the PID belongs to another process
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    """Wait for ``done()`` (a process's files stay open until it has ended: on Windows,
    the installer cannot replace them before)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _end(process: psutil.Process | None, done: Callable[[], bool],
         timeout_s: float = STOP_GRACE_S) -> None:
    """Terminate a process (TerminateProcess on Windows) that is still the one recorded;
    psutil checks the start time again right before it signals."""
    if process is None or done():
        return
    with contextlib.suppress(psutil.Error):
        process.terminate()
    _wait(done, timeout_s)


def _stop_one(instance: RunningInstance, folder: Path, token_file: Path,
              timeout_s: float) -> bool:
    """Ask the server to finish its queue and exit; end it (and its tray) if they will
    not. True when both are gone. Only processes whose PID and start time both match
    what was recorded are ever signalled: never a PID the system has given to another."""
    from tray.client import ApiClient, NotVramguard, ServerDown

    server = same_process(instance.pid, instance.started)
    launcher = same_process(instance.launcher_pid, instance.launcher_started)
    with contextlib.suppress(OSError):  # its tray must not take the end for a crash
        request_stop(folder, instance.port)
    try:
        with ApiClient(instance.url, token_file) as client:
            client.shutdown()
    except NotVramguard as exc:
        ending = " Ending vramguard's own process instead." if server else ""
        print(f"vramguard: {exc}{ending}", file=sys.stderr)
        timeout_s = 0
    except (ServerDown, RuntimeError) as exc:
        print(f"vramguard on port {instance.port} did not take the stop request ({exc}); "
              "ending it.", file=sys.stderr)
        timeout_s = 0

    def server_done() -> bool:
        return _gone(server) and not is_held(folder, instance.port)

    # The server first, then the launcher: its tray sees its server end after the stop
    # request (the marker above: even an ended server, status 15 on Windows, is not
    # restarted) and quits by itself, taking its icon away. Ending the launcher first
    # (TerminateProcess on Windows) left a ghost icon in the tray. Only a launcher that
    # has not quit within LAUNCHER_GRACE_S is ended, then killed.
    if not _wait(server_done, timeout_s):
        _end(server, server_done)
    if launcher is not None and not _wait(lambda: _gone(launcher), LAUNCHER_GRACE_S):
        _end(launcher, lambda: _gone(launcher))
        if not _gone(launcher):
            with contextlib.suppress(psutil.Error):
                launcher.kill()
            _wait(lambda: _gone(launcher), STOP_GRACE_S)
    return server_done() and _gone(launcher)


def stop(settings: Settings, port: int | None, timeout_s: float) -> int:
    """`vramguard stop`: every running server of this user, or the one on `port`."""
    folder = instance_folder(settings.token_file)
    targets = [instance for instance in running_instances(folder)
               if port is None or instance.port == port]
    if not targets:
        print("vramguard is not running.")
        return 0
    failed = 0
    for instance in targets:
        if _stop_one(instance, folder, settings.token_file, timeout_s):
            print(f"Stopped vramguard on port {instance.port}.")
        else:
            print(f"vramguard on port {instance.port} (process {instance.pid}) did not stop.",
                  file=sys.stderr)
            failed += 1
    return 1 if failed else 0
