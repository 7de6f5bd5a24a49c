"""One vramguard per port: the lock, a second launch, and `vramguard stop`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from live_server import ROOT, live_server

from app.instance import InstanceLock, is_held, running_instance, running_instances

HOLD = """
import sys, time
from pathlib import Path
from app.instance import InstanceLock
lock = InstanceLock(Path(sys.argv[1]), 9999)
assert lock.acquire("http://127.0.0.1:9999")
print("held", flush=True)
time.sleep(60)
"""


def test_the_lock_is_exclusive_and_says_who_holds_it(tmp_path):
    first = InstanceLock(tmp_path, 8765)
    assert first.acquire("http://127.0.0.1:8765")
    assert not InstanceLock(tmp_path, 8765).acquire("http://127.0.0.1:8765")
    other_port = InstanceLock(tmp_path, 8766)
    assert other_port.acquire("http://127.0.0.1:8766")
    instance = running_instance(tmp_path, 8765)
    assert instance is not None and instance.pid == os.getpid()
    assert instance.url == "http://127.0.0.1:8765"
    assert [i.port for i in running_instances(tmp_path)] == [8765, 8766]
    first.release()
    assert not is_held(tmp_path, 8765) and running_instance(tmp_path, 8765) is None


def test_a_killed_server_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert running_instance(tmp_path, 9999).pid == holder.pid
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    assert not is_held(tmp_path, 9999)  # the OS dropped the lock with the process
    assert InstanceLock(tmp_path, 9999).acquire("http://127.0.0.1:9999")


RECORD_URL = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"


def cli(server, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")},
           "HOME": str(server.home), "VRAMGUARD_TOKEN_FILE": str(server.token_file),
           **env_vars}
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_second_launch_announces_the_first_and_stop_ends_it(tmp_path):
    with live_server(tmp_path, "--no-cache") as server:
        port = server.url.rsplit(":", 1)[1]
        again = cli(server, "serve", "--port", port)
        assert again.returncode == 0
        assert f"vramguard is already running at {server.url}" in again.stderr
        assert f"process {server.process.pid}" in again.stderr
        # The desktop shortcut (`run`) clicked again opens the running one's dashboard.
        opened = tmp_path / "opened-url"
        browser = f"{sys.executable} -c \"{RECORD_URL}\" {opened} %s"
        shortcut = cli(server, "run", "--port", port, DISPLAY=":0", BROWSER=browser)
        assert shortcut.returncode == 0 and "already running" in shortcut.stderr
        assert opened.read_text().startswith(f"{server.url}/ui#")
        stopped = cli(server, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert f"Stopped vramguard on port {port}" in stopped.stdout
        assert server.process.wait(30) == 0
        assert "Traceback" not in server.log_text()
    assert cli(server, "stop").stdout.strip() == "vramguard is not running."
