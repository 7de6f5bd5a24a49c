"""Start the real appliance (`python -m app serve`) on a free 127.0.0.1 port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def live_server(tmp: Path, *args: str, env: dict[str, str] | None = None,
                ready_timeout: float = 180) -> Iterator[LiveServer]:
    """Run the server until the block ends; fail with its log if it never gets ready."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    home = tmp / f"home-{port}"
    isolated = {var: str(home / var.lower()) for var in
                ("HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")}
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    full_env = {**inherited, **isolated, "VRAMGUARD_CACHE_DIR": str(tmp / f"cache-{port}"),
                **(env or {})}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", str(port), *args],
            cwd=ROOT, env=full_env, stdout=sink, stderr=subprocess.STDOUT)
    server = LiveServer(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_text()}")
            try:
                if httpx.get(f"{server.url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {ready_timeout} s:\n{server.log_text()}")
            time.sleep(0.2)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
