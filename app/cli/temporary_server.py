"""A vramguard started for one command's run, on a free port, and stopped at its end
(``vramguard classify`` when none is running)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

import httpx

READY_TIMEOUT_S = 600  # a first start on Windows can take minutes (README)


class StartFailed(Exception):
    """It stopped, or was not ready in time; the message ends with its last lines."""


class TemporaryServer:
    """A vramguard started for this run (on a free port) and stopped at its end."""

    def __init__(self, model: str | None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        frozen = getattr(sys, "frozen", False)  # the bundle's executable is the command
        command = [sys.executable, *([] if frozen else ["-m", "app"]), "serve",
                   "--port", str(self.port), *(["--model", model] if model else [])]
        # Its output, for when it fails to start; closed in stop(), as long as it runs.
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        # Its own process group (Windows) or session: the terminal's Ctrl-C is ours to
        # handle; we stop it.
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            creationflags=getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StartFailed(f"the vramguard started for this run stopped:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2,
                             trust_env=False).status_code == 200:
                    return
            time.sleep(0.5)
        raise StartFailed(f"the vramguard started for this run was not ready in "
                    f"{READY_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode("utf-8", "replace").splitlines()[-15:])

    def stop(self) -> None:
        """Ask it to finish (SIGTERM, Ctrl+Break on Windows); end it if it does not."""
        if self.process.poll() is None:
            if sys.platform == "win32":
                self.process.send_signal(signal.CTRL_BREAK_EVENT)
            else:
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def answers(url: str) -> bool:
    """Whether anything answers HTTP at ``url`` (a vramguard or not: the run then says so)."""
    try:
        httpx.get(f"{url}/healthz", timeout=3, trust_env=False)  # this computer: no proxy
    except httpx.HTTPError:
        return False
    return True
