"""A real Redis server on 127.0.0.1 for the cluster benchmark and tests: Debian's
``redis-server`` on a free port, without persistence, in a temporary folder; ``stop()``
and ``start()`` again on the same port play an outage."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bench.process import free_port

START_TIMEOUT_S = 10.0


def answers_ping(port: int) -> bool:
    """Whether a server on the port answers PING (raw protocol: no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process; ``url`` points at database 0."""

    def __init__(self, directory: Path | None = None, port: int | None = None) -> None:
        if directory is None:  # removed with this object (TemporaryDirectory's finalizer)
            self._own_dir = tempfile.TemporaryDirectory(prefix="vg-redis-")
            directory = Path(self._own_dir.name)
        self.directory = directory
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_file(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> None:
        """Start (again, on the same port) and wait until it answers PING."""
        if self.process is not None and self.process.poll() is None:
            return
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt install redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), "--logfile",
             str(self.log_file), "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = self.log_file.read_text() if self.log_file.exists() else ""
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop it (its data goes: there is no persistence); ``start()`` brings it back on
        the same port. A stopped (SIGSTOP) server is killed after 5 s."""
        if self.process is None:
            return
        process, self.process = self.process, None
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
