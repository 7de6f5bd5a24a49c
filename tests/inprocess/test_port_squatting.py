"""Another program answers on vramguard's port (it took the port while vramguard was down,
restarting, or lost the race for it). The tray, `vramguard stop` and the second launch
make the server prove it knows the admin token before they send it anything, send a
server that fails nothing (no token, no action), and open only what they build
themselves. Real sockets, no model: squatters are tiny HTTP servers, the real vramguard
is the app behind uvicorn in a thread."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
import webbrowser
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
import pytest
import vramguard_client as vg
from live_server import ROOT
from squatter import EVIL_URL, Squatter, knowing, relay_to, served_app

from app.cli.main import main
from app.host.instance import InstanceLock, instance_folder
from app.host.token_file import load_or_create_token
from tray.client import ApiClient
from tray.controller import TrayController

HOLD = """
import sys, time
from pathlib import Path
from app.host.instance import InstanceLock
lock = InstanceLock(Path(sys.argv[1]), int(sys.argv[2]))
assert lock.acquire(f"http://127.0.0.1:{sys.argv[2]}")
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What would have been handed to the browser (on Windows: to os.startfile)."""
    calls: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: calls.append(url) or True)
    return calls


def tray_at(url: str, token_file: Path) -> tuple[TrayController, list[str]]:
    said: list[str] = []
    return TrayController(ApiClient(url, token_file), notify=said.append), said


def launch_file(uri: str) -> Path:
    """The file a file:// URI names."""
    parsed = urlparse(uri)
    assert parsed.scheme == "file", uri
    return Path(unquote(parsed.path))


def target_of(page: Path) -> str:
    """Where a launch page sends the browser (its meta refresh)."""
    match = re.search(r'http-equiv="refresh" content="0;url=([^"]+)"', page.read_text())
    assert match, page.read_text()
    return match.group(1).replace("&amp;", "&")


def test_the_tray_sends_a_squatter_no_token_and_no_action(tmp_path, opened):
    token_file = tmp_path / "admin-token"
    load_or_create_token(token_file)
    with Squatter() as squatter:
        tray, _ = tray_at(squatter.url, token_file)
        said = [tray.empty_cache(), tray.reset_peak(), tray.toggle_pause()]
        tray.client.close()
    assert squatter.with_token() == []
    assert set(squatter.paths()) <= {"/v1/identity", "/v1/memory", "/v1/stats"}, \
        squatter.paths()
    for message in said:
        assert f"Another program is answering on port {squatter.port}" in message, message
    assert opened == []


def test_the_tray_opens_nothing_a_squatter_offers(tmp_path, opened):
    token_file = tmp_path / "admin-token"
    load_or_create_token(token_file)
    with Squatter() as squatter:
        tray, _ = tray_at(squatter.url, token_file)
        message = tray.open_dashboard()
        tray.client.close()
    assert opened == [] and squatter.with_token() == []
    assert message is not None and f"port {squatter.port}" in message


def test_a_relayed_challenge_fails_because_the_port_is_in_the_proof(tmp_path):
    """The squatter on port A hands the tray's challenge to the real vramguard on port B
    and passes the real answer back: the answer is bound to B, so it fails on A."""
    with served_app(tmp_path) as real:
        direct = ApiClient(real.url, real.token_file)
        assert direct.set_paused(True) == {"paused": True}  # the real one proves itself
        assert direct.set_paused(False) == {"paused": False}
        direct.close()
        statuses: list[int] = []
        with Squatter(relay_to(real.url, statuses)) as relay:
            relayed = ApiClient(relay.url, real.token_file)
            with pytest.raises(Exception, match=f"Another program is answering on port "
                                                f"{relay.port}"):
                relayed.set_paused(True)
            relayed.close()
        assert relay.paths() == ["/v1/identity"] and statuses == [200]  # really answered
        assert relay.with_token() == []
        assert real.app.state.vg.engine.paused is False


def test_a_relay_on_the_other_loopback_family_gets_no_token(tmp_path):
    """Issue 26: vramguard listens on ::1; another user holds 127.0.0.1 on the same port
    and relays everything to [::1]. The real answer is bound to ::1, so a client that
    reached 127.0.0.1 refuses it; the tray and the Python client, pointed at where the
    server listens (the instance file says [::1]), prove it and act."""
    with served_app(tmp_path, host="::1") as real:
        statuses: list[int] = []
        with Squatter(relay_to(real.url, statuses), port=real.port) as relay:
            assert relay.port == real.port and relay.url != real.url
            tray = ApiClient(relay.url, real.token_file)
            with pytest.raises(Exception, match=f"Another program is answering on port "
                                                f"{relay.port}"):
                tray.set_paused(True)
            tray.close()
            with vg.Client(relay.url, token_file=real.token_file) as client, \
                    pytest.raises(vg.NotVramguard):
                client.pause()
            assert relay.paths() == ["/v1/identity", "/v1/identity"] and \
                statuses == [200, 200]  # the real server answered both
            assert relay.with_token() == []
            direct = ApiClient(real.url, real.token_file)
            assert direct.set_paused(True) == {"paused": True}
            direct.close()
            assert real.app.state.vg.engine.paused is True
            with vg.Client(real.url, token_file=real.token_file) as client:
                client.resume()
        assert real.app.state.vg.engine.paused is False


def test_stop_sends_a_squatter_no_token(tmp_path, capsys, monkeypatch):
    """vramguard holds its lock but another program holds the port: `stop` asks nothing
    of that program, and ends vramguard's own process (checked by its start time)."""
    token_file = tmp_path / "config" / "admin-token"
    load_or_create_token(token_file)
    monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(token_file))
    with Squatter() as squatter:
        holder = subprocess.Popen([sys.executable, "-c", HOLD,
                                   str(instance_folder(token_file)), str(squatter.port)],
                                  cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert main(["stop", "--port", str(squatter.port)]) == 0
            assert holder.wait(10) is not None
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
    assert squatter.with_token() == [] and "/v1/admin/shutdown" not in squatter.paths()
    err = capsys.readouterr().err
    assert f"Another program is answering on port {squatter.port}" in err


def test_the_tray_opens_only_what_it_builds(tmp_path, opened):
    """Even a server that passes the challenge does not choose what the browser opens:
    its 'url' (a program to run) is ignored; the tray builds the page itself."""
    token_file = tmp_path / "admin-token"
    token = load_or_create_token(token_file)
    code = "A-good_code-0123456789abcdef"
    with Squatter(knowing(token, code=code)) as fake:
        tray, _ = tray_at(fake.url, token_file)
        assert tray.open_dashboard() is None
        tray.client.close()
    assert len(opened) == 1 and EVIL_URL not in opened[0]
    page = launch_file(opened[0])
    assert page.parent == instance_folder(token_file)
    assert target_of(page) == f"{fake.url}/ui#code={code}"


@pytest.mark.parametrize("code", ['"><script>alert(1)</script>', "a b", "", "é" * 30])
def test_a_code_that_is_not_a_code_opens_nothing(tmp_path, opened, code):
    token_file = tmp_path / "admin-token"
    token = load_or_create_token(token_file)
    with Squatter(knowing(token, code=code)) as fake:
        tray, _ = tray_at(fake.url, token_file)
        message = tray.open_dashboard()
        tray.client.close()
    assert opened == [] and message is not None
    assert not list(instance_folder(token_file).glob("dashboard-*"))


def assert_opened_without_the_code(opened: list[str], real_url: str) -> str:
    """The argv watcher: what went to the browser's command line holds no code; the file
    it names is private and sends the browser to this server's /ui with a live code.
    Returns the code."""
    assert len(opened) == 1
    argv = opened[0]
    assert "code" not in argv and real_url not in argv
    page = launch_file(argv)
    assert stat.S_IMODE(page.stat().st_mode) == 0o600
    assert stat.S_IMODE(page.parent.stat().st_mode) == 0o700
    target = target_of(page)
    assert target.startswith(f"{real_url}/ui#code=")
    code = target.split("#code=", 1)[1]
    assert code and code not in argv
    assert f'location.replace("{target}")' in page.read_text()
    return code


def test_the_tray_opens_the_dashboard_without_the_code_on_any_command_line(tmp_path, opened):
    with served_app(tmp_path) as real:
        tray, _ = tray_at(real.url, real.token_file)
        assert tray.open_dashboard() is None
        tray.client.close()
        code = assert_opened_without_the_code(opened, real.url)
        redeemed = httpx.post(f"{real.url}/v1/ui/session", json={"code": code})
        assert redeemed.status_code == 200  # the page in the browser would get the session


def test_the_second_launch_opens_the_dashboard_without_the_code_on_any_command_line(
        tmp_path, opened, monkeypatch, capsys):
    with served_app(tmp_path) as real:
        monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(real.token_file))
        monkeypatch.setenv("DISPLAY", ":0")  # a desktop: `run` is the shortcut's command
        lock = InstanceLock(instance_folder(real.token_file), real.port)
        assert lock.acquire(real.url)
        try:
            assert main(["run", "--port", str(real.port)]) == 0
        finally:
            lock.release()
        code = assert_opened_without_the_code(opened, real.url)
        assert httpx.post(f"{real.url}/v1/ui/session", json={"code": code}).status_code == 200
    assert "already running" in capsys.readouterr().err


def test_the_second_launch_opens_nothing_a_squatter_offers(tmp_path, opened, monkeypatch,
                                                          capsys):
    token_file = tmp_path / "admin-token"
    load_or_create_token(token_file)
    monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("DISPLAY", ":0")
    with Squatter() as squatter:
        lock = InstanceLock(instance_folder(token_file), squatter.port)
        assert lock.acquire(squatter.url)
        try:
            assert main(["run", "--port", str(squatter.port)]) == 1
        finally:
            lock.release()
    assert opened == [] and squatter.with_token() == []
    assert f"Another program is answering on port {squatter.port}" in capsys.readouterr().err


def test_a_launch_file_is_deleted_soon_and_old_ones_on_next_use(tmp_path, opened):
    from tray.dashboard import DashboardOpener

    with served_app(tmp_path) as real:
        folder = instance_folder(real.token_file)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        stale = folder / "dashboard-stale.html"
        stale.write_text("an old code")
        old = time.time() - 3600
        os.utime(stale, (old, old))
        client = ApiClient(real.url, real.token_file)
        opener = DashboardOpener(client, folder, keep_s=0.2)
        assert opener.open() is None
        client.close()
        page = launch_file(opened[0])
        assert page.exists() and not stale.exists()
        deadline = time.monotonic() + 5
        while page.exists():
            assert time.monotonic() < deadline, "the launch file was not deleted"
            time.sleep(0.05)
