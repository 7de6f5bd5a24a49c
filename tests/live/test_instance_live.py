"""A second launch against a real server: it names the first, the desktop shortcut opens
the running one's dashboard, and `vramguard stop` ends it (the lock itself:
unit/host/test_instance.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
from live_server import ROOT, live_server

# (no colon in it: webbrowser splits $BROWSER at os.pathsep)
RECORD_ARGV = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv))"


def cli(server, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")},
           "HOME": str(server.home), "VRAMGUARD_TOKEN_FILE": str(server.token_file),
           **env_vars}
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_second_launch_announces_the_first_and_stop_ends_it(tmp_path):
    with live_server(tmp_path, "--no-cache") as server:
        port = server.url.rsplit(":", 1)[1]
        again = cli(server, "serve", "--port", port)
        assert again.returncode == 0
        assert f"vramguard is already running at {server.url}" in again.stderr
        assert f"process {server.process.pid}" in again.stderr
        # The desktop shortcut (`run`) clicked again opens the running one's dashboard.
        # The browser's whole command line is recorded: it names a private page, which
        # holds the one-time code; the code itself is on no command line.
        opened = tmp_path / "browser-argv"
        browser = f"{sys.executable} -c \"{RECORD_ARGV}\" {opened} %s"
        shortcut = cli(server, "run", "--port", port, DISPLAY=":0", BROWSER=browser)
        assert shortcut.returncode == 0 and "already running" in shortcut.stderr
        argv = json.loads(opened.read_text())[2:]  # after -c and the record's own file
        assert len(argv) == 1 and argv[0].startswith("file://") and "code" not in argv[0]
        page = Path(argv[0].removeprefix("file://"))
        assert stat.S_IMODE(page.stat().st_mode) == 0o600
        target = f'content="0;url={server.url}/ui#code='
        assert target in page.read_text()
        code = page.read_text().split(target)[1].split('"')[0]
        assert code not in " ".join(argv)
        assert httpx.post(f"{server.url}/v1/ui/session", json={"code": code}).status_code == 200
        stopped = cli(server, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert f"Stopped vramguard on port {port}" in stopped.stdout
        assert server.process.wait(30) == 0
        assert "Traceback" not in server.log_text()
    assert cli(server, "stop").stdout.strip() == "vramguard is not running."
