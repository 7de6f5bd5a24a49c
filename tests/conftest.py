"""Shared fixtures: the tests' own folder on the import path, isolated user folders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from live_server import USER_DIRS


@pytest.fixture(autouse=True)
def _isolated_user_dirs(tmp_path_factory, monkeypatch):
    """Never read or write the real user's config, cache or logs."""
    home = tmp_path_factory.mktemp("home")
    for var in USER_DIRS:
        monkeypatch.setenv(var, str(home / var.lower()))
    for name in list(__import__("os").environ):
        if name.startswith("VRAMGUARD_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real server for the session: default model, result cache off, no rate limit
    (tests of their own check the limiter), batch size 4 (warmup's own choice depends on
    how busy the machine is while it measures; its logic has unit tests)."""
    from live_server import live_server

    with live_server(tmp_path_factory.mktemp("server"), "--no-cache", "--batch-size", "4",
                     env={"VRAMGUARD_RATE_LIMIT": "0"}) as running:
        yield running


@pytest.fixture(scope="session")
def cached_server(tmp_path_factory):
    """A second real server with the result cache on."""
    from live_server import live_server

    with live_server(tmp_path_factory.mktemp("cached"),
                     env={"VRAMGUARD_RATE_LIMIT": "0"}) as running:
        yield running
