"""A real Redis server for the cluster tests (bench/redis_server.py): ``redis_server``
yields a started one and always stops it; ``stop()`` and ``start()`` again on the same
port play an outage.

The cluster tier's conftest.py provides ``redis_server`` to its tests; ``RedisServer()``
starts a server of another scope. Tests are skipped, saying why, where
``redis-server`` or the ``redis`` package (the cluster extra) is missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.redis_server import RedisServer

__all__ = ["RedisServer", "redis_server"]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started Redis, stopped after the test whatever happens."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt install redis-server)")
    pytest.importorskip("redis", reason="the redis package is missing: pip install -e "
                        "'.[cluster]'")
    server = RedisServer(tmp_path / "redis")
    try:
        server.start()
        yield server
    finally:
        server.stop()
