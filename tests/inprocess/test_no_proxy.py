"""A proxy in the environment (or, on Windows, in the system's settings, which httpx
reads the same way and whose exception list it ignores: encode/httpx#1536) never carries
traffic to this computer's own vramguard (issue 27). A dead proxy is set in every
variable httpx reads; the tray's client, `vramguard classify`'s checks and the Python
client still reach the real server on 127.0.0.1, and a remote URL still goes through
the proxy as the environment says."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
import vramguard_client as vg
from squatter import Served, served_app

from app.cli.temporary_server import answers
from tray.client import ApiClient

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                   "all_proxy")


@pytest.fixture
def dead_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A proxy address where nothing listens, in every proxy variable; no exceptions."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield proxy


@pytest.fixture
def real(tmp_path) -> Iterator[Served]:
    with served_app(tmp_path) as served:
        yield served


def test_the_proxy_is_dead_for_everyone_else(dead_proxy: str, real: Served) -> None:
    """The test's premise: httpx on its defaults sends loopback traffic to the proxy."""
    with pytest.raises(httpx.ConnectError):  # the proxy's address refuses
        httpx.get(f"{real.url}/healthz", timeout=3)


def test_the_tray_reaches_its_server(dead_proxy: str, real: Served) -> None:
    with ApiClient(real.url, real.token_file) as tray:
        assert tray.set_paused(True) == {"paused": True}  # the proof and the admin call
        assert tray.set_paused(False) == {"paused": False}


def test_classify_finds_its_server(dead_proxy: str, real: Served) -> None:
    assert answers(real.url)


def test_the_python_client_reaches_a_local_server(dead_proxy: str, real: Served) -> None:
    with vg.Client(real.url, token_file=real.token_file) as client:
        assert client.location.local
        assert client.models()
        client.pause()
        client.resume()


def test_a_remote_url_keeps_the_environments_proxy(dead_proxy: str) -> None:
    """What the environment says still holds for another computer: the request goes to
    the (dead) proxy, which is why nothing answers, without a name lookup of its own."""
    with vg.Client("http://vision.example.invalid:8765", max_retries=0, timeout=5) as client:
        assert not client.location.local
        with pytest.raises(vg.NotRunning, match="Connection refused"):
            client.models()  # a lookup of .invalid would fail with a name error instead
