"""Start the real appliance (`python -m app serve`) on a free 127.0.0.1 port."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.process import ROOT, free_port, running

__all__ = ["ROOT", "LiveServer", "live_server"]
USER_DIRS = ("HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")
"""The variables that point at a user's folders; every test gets its own."""


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    token_file: Path
    home: Path

    def token(self) -> str:
        return self.token_file.read_text().strip()

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token()}"}

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def live_server(tmp: Path, *args: str, env: dict[str, str] | None = None,
                preexec_fn: Callable[[], object] | None = None) -> Iterator[LiveServer]:
    """Run the server, isolated from the real user's folders, until the block ends;
    ``preexec_fn`` runs in its process before it starts."""
    port = free_port()
    home = tmp / f"home-{port}"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    full_env = {**inherited, **{var: str(home / var.lower()) for var in USER_DIRS},
                "VRAMGUARD_CACHE_DIR": str(tmp / f"cache-{port}"),
                "VRAMGUARD_TOKEN_FILE": str(home / "admin-token"), **(env or {})}
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"server-{port}.log"
    command = [sys.executable, "-m", "app", "serve", "--port", str(port), *args]
    with running(command, f"{url}/readyz", log, env=full_env, preexec_fn=preexec_fn) as process:
        yield LiveServer(url, process, log, home / "admin-token", home)
