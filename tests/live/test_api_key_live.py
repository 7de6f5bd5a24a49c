"""The API key against real servers: a start refused with one message, and the tray's
readings on a keyed server (the gate itself: inprocess/test_api_key.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from api_key_file import key_file
from live_server import ROOT, USER_DIRS, free_port


def test_serve_refuses_to_start_with_one_message(tmp_path: Path) -> None:
    path = key_file(tmp_path, "short\n")
    home = tmp_path / "home"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")},
           **{var: str(home / var.lower()) for var in USER_DIRS},
           "VRAMGUARD_API_KEY_FILE": str(path)}
    done = subprocess.run([sys.executable, "-m", "app", "serve", "--port", str(free_port()),
                           "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"vramguard: The API key in {path} has 5 characters" in done.stderr


def test_the_trays_readings_work_on_a_keyed_server(tmp_path: Path) -> None:
    """The tray has no API key, only the admin token: its first reading gets 401, then it
    proves the server and sends the token in the key's place; a program that cannot
    prove it holds the token (another token file) gets no token and shows as down."""
    from live_server import live_server

    from tray.client import ApiClient, ServerDown

    with live_server(tmp_path, "--no-cache", "--device", "cpu",
                     env={"VRAMGUARD_API_KEY_FILE": str(key_file(tmp_path))}) as server:
        assert server.client().get("/v1/memory").status_code == 401
        with ApiClient(server.url, server.token_file) as tray:
            first, second = tray.sample(), tray.sample()
        assert tray.keyed and first.device == second.device == "cpu"
        # Refused twice in all (our own probe and the tray's first reading), never again.
        assert first.requests["unauthorized"] == second.requests["unauthorized"] == 2
        stranger = tmp_path / "other-token"
        stranger.write_text("x" * 43)
        stranger.chmod(0o600)
        with ApiClient(server.url, stranger) as tray, \
                pytest.raises(ServerDown, match="Nothing was sent to it"):
            tray.sample()
