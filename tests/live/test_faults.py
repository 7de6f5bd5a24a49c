"""Faults from outside the request path, with a server process of its own: a killed
server, an unreadable token file, a full disk. Each ends in one clear message that names
the file and what to do, or in a server that carries on (a broken config file:
unit/cli/test_cli.py; damaged weights and a deleted token file in process:
inprocess/test_file_faults.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from images import photo
from live_server import ROOT, USER_DIRS, free_port, live_server
from small_disk import fill, mounted

JPEG = {"Content-Type": "image/jpeg"}


def serve_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "app", "serve", "--port", str(port), *args]


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a server whose user folders all lie under ``home``."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    return {**inherited, **{var: str(home / var.lower()) for var in USER_DIRS}, **extra}


def refused_at_start(command: list[str], env: dict[str, str]) -> str:
    """Run a start that must fail by itself; its stderr (one message, no traceback)."""
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real, tiny filesystem (tmpfs, 256 KiB) filled to the last byte."""
    with mounted(tmp_path / "full", "256k") as mount:
        fill(mount)
        yield mount


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to hand a file to another user, and setpriv")
def test_an_unreadable_token_file_is_one_message(tmp_path):
    """Root reads any file, so the server runs without the capabilities that allow it:
    exactly what an ordinary user has."""
    token = tmp_path / "home" / "admin-token"
    token.parent.mkdir()
    token.write_text("someone-else's\n")
    os.chown(token, 65534, 65534)
    token.chmod(0o600)
    unprivileged = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    err = refused_at_start([*unprivileged, *serve_command(free_port())],
                           user_env(tmp_path / "home", VRAMGUARD_TOKEN_FILE=str(token)))
    assert f"cannot read or create the admin token file {token}: permission denied" in err


def test_a_full_disk_under_the_token_is_one_message(tmp_path, full_disk):
    token = full_disk / "config" / "admin-token"
    err = refused_at_start(serve_command(free_port()),
                           user_env(tmp_path / "home", VRAMGUARD_TOKEN_FILE=str(token)))
    assert f"admin token file {token}: the disk is full. Free some space on it" in err


def test_a_full_disk_under_the_log_and_cache_still_serves(tmp_path, full_disk):
    env = {"VRAMGUARD_LOG_DIR": str(full_disk / "log"),
           "VRAMGUARD_CACHE_DIR": str(full_disk / "cache"), "VRAMGUARD_RATE_LIMIT": "0"}
    with live_server(tmp_path, env=env) as server, server.client() as client:
        answer = client.post("/v1/classify", content=photo(), headers=JPEG)
        assert answer.status_code == 200 and answer.json()["cached"] is False
        log = server.log_text()  # the server's own output: stderr
    assert f"cannot write the log file in {full_disk / 'log'}: the disk is full" in log
    assert f"cannot use the result cache in {full_disk / 'cache'}: the disk is full" in log
    assert "Traceback" not in log


def test_kill_9_during_a_burst_then_restart_serves_from_an_intact_cache(tmp_path):
    cache = tmp_path / "shared-cache"
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
    env = {"VRAMGUARD_CACHE_DIR": str(cache), "VRAMGUARD_RATE_LIMIT": "0"}
    with live_server(tmp_path / "first", env=env) as server:
        with server.client() as client:
            first = client.post("/v1/classify", content=photo(), headers=JPEG).json()
        answers: list[int] = []

        def send(index: int) -> None:
            body = photo() + bytes([index])  # distinct bytes: each one is computed
            try:
                with server.client() as client:
                    answers.append(client.post("/v1/classify", content=body,
                                               headers=JPEG).status_code)
            except httpx.TransportError:
                answers.append(0)

        burst = [threading.Thread(target=send, args=(i,)) for i in range(16)]
        for thread in burst:
            thread.start()
        while server.process.poll() is None and not answers:
            threading.Event().wait(0.05)  # some answers written to the cache, some not
        server.process.send_signal(signal.SIGKILL)
        for thread in burst:
            thread.join(60)
    with live_server(tmp_path / "second", env=env) as restarted, \
            restarted.client() as client:
        again = client.post("/v1/classify", content=photo(), headers=JPEG)
        assert again.status_code == 200
        assert again.json()["predictions"] == first["predictions"]
        assert again.json()["cached"] is True  # what was written before the kill is kept
        fresh = client.post("/v1/classify", content=photo() + b"new", headers=JPEG)
        assert fresh.status_code == 200
