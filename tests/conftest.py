"""Shared fixtures and the tiers.

A test's tier is its folder (LitServe's way): ``unit/`` (one module, no server) and
``inprocess/`` (the app over ``httpx.ASGITransport``) are the fast tier, run on every
change; ``live/`` (real servers on 127.0.0.1), ``desktop/`` (Xvfb, a tray host, a
browser), ``packaging/`` (the bundle and the installer) and ``cluster/`` (real Redis
and Ray) get the markers below from their path, so ``-m`` still selects them. A fast
folder may not hold a test marked ``slow`` (``unit/test_tiers.py``).
Helpers live in ``support/``, which is on the import path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))
from live_server import USER_DIRS

TESTS = Path(__file__).parent

TIER_MARKERS = {
    "live": ("slow",),
    "desktop": ("slow", "desktop"),
    "packaging": ("slow", "packaging"),
    "cluster": ("slow", "cluster"),
}
FAST_TIERS = frozenset({"unit", "inprocess"})
LANES = {"live": "servers", "desktop": "servers", "cluster": "servers",
         "packaging": "packaging"}
"""With pytest-xdist (pyproject.toml: two workers), each lane runs on one worker, in
order: tests that start servers never run two at once (their deadlines are set for one
machine's worth of CPU), while the bundle and the installer, mostly disk and one core,
build beside them at a lower priority (tests/packaging/test_packaging.py). The fast tiers
fill in, a file at a time, wherever a worker is free."""


def tier_of(path: Path) -> str:
    """The first folder under tests/ (a test file sits in one)."""
    return path.resolve().relative_to(TESTS.resolve()).parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(Path(str(item.path)))
        if tier in FAST_TIERS:
            continue
        if tier not in TIER_MARKERS:
            raise pytest.UsageError(f"{item.nodeid}: tests/{tier}/ is not a tier "
                                    f"(one of {sorted(FAST_TIERS | set(TIER_MARKERS))})")
        for marker in TIER_MARKERS[tier]:
            item.add_marker(marker)


def lane_of(nodeid: str) -> str:
    """The unit of work pytest-xdist gives one worker: a lane's name, or a fast test's
    file. (xdist's own loadgroup marks are not honoured with this pytest.)"""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return LANES.get(tier, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's scheduler by scope, with the lanes as scopes: the largest first,
    one to each worker, then the fast tiers' files to whichever is free."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Run ``@pytest.mark.anyio`` tests on asyncio only (trio is installed, the app is not
    written for it)."""
    return "asyncio"


@pytest.fixture(autouse=True)
def _isolated_user_dirs(tmp_path_factory, monkeypatch):
    """Never read or write the real user's config, cache or logs."""
    home = tmp_path_factory.mktemp("home")
    for var in USER_DIRS:
        monkeypatch.setenv(var, str(home / var.lower()))
    for name in list(__import__("os").environ):
        if name.startswith("VRAMGUARD_"):
            monkeypatch.delenv(name)
    # The per-computer folder where vramguards on one GPU find each other: one per test,
    # or the CUDA stand-ins of tests running side by side would share their one "GPU".
    monkeypatch.setenv("VRAMGUARD_GPU_CLAIMS_DIR", str(home / "gpu-claims"))


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
