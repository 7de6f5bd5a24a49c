"""One vramguard per port: the lock, its files, and `vramguard stop` (a second launch
against a real server: live/test_instance_live.py)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest
from live_server import ROOT, free_port

from app.cli.main import main
from app.host.instance import (
    InstanceLock,
    instance_folder,
    is_held,
    running_instance,
    running_instances,
    stop_requested,
)

HOLD = """
import sys, time
from pathlib import Path
from app.host.instance import InstanceLock
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


def test_instance_files_are_private_and_never_followed_through_links(tmp_path):
    """Another user (or a stale link) must not make vramguard write through a link: the
    lock and its description are created without following links, in a 0700 folder."""
    folder = tmp_path / "run"
    lock = InstanceLock(folder, 8765)
    assert lock.acquire("http://127.0.0.1:8765")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("instance-8765.lock", "instance-8765.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    lock.release()

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    for name in ("instance-8766.json", "instance-8766.tmp"):  # .tmp: the name once used
        (folder / name).symlink_to(victim)
    described = InstanceLock(folder, 8766)
    assert described.acquire("http://127.0.0.1:8766")
    assert victim.read_text() == "keep me"  # the link was replaced, not written through
    assert not (folder / "instance-8766.json").is_symlink()
    described.release()

    (folder / "instance-8767.lock").symlink_to(victim)
    with pytest.raises(OSError):
        InstanceLock(folder, 8767).acquire("http://127.0.0.1:8767")
    assert victim.read_text() == "keep me"
    assert not is_held(folder, 8767)


def test_a_linked_description_is_not_read(tmp_path):
    folder = tmp_path / "run"
    lock = InstanceLock(folder, 8765)
    assert lock.acquire("http://127.0.0.1:8765")
    info = folder / "instance-8765.json"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"pid": 1, "port": 8765, "url": "http://127.0.0.1:8765",
                                     "started": 0.0}))
    info.unlink()
    info.symlink_to(elsewhere)
    instance = running_instance(folder, 8765)
    assert instance is not None and instance.pid == 0  # held, but not described: no pid
    lock.release()


def test_a_loose_instance_folder_is_made_private(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    assert InstanceLock(folder, 8765).acquire("http://127.0.0.1:8765")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.fixture
def bystander():
    """A live process that has nothing to do with vramguard (what a reused PID points at)."""
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def describe(folder, port: int, **fields: object) -> None:
    """Rewrite the lock's description the way a reused PID would leave it."""
    info = folder / f"instance-{port}.json"
    data = json.loads(info.read_text())
    data.update(fields)
    info.unlink()
    info.write_text(json.dumps(data))


def hold(folder, port: int) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace("9999", str(port)),
                               str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("whose", ["launcher", "server"])
@pytest.mark.parametrize("start", ["another", "absent"])
def test_stop_never_signals_a_reused_pid(tmp_path, monkeypatch, capsys, bystander, whose,
                                         start):
    """The description names a live process that is not vramguard (its PID was reused):
    its recorded start time differs or is missing, so `stop` leaves it alone."""
    token_file = tmp_path / "config" / "admin-token"
    monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(token_file))
    folder = instance_folder(token_file)
    port = free_port()
    holder = hold(folder, port)
    try:
        recorded = {"another": psutil.Process(bystander.pid).create_time() - 1000.0,
                    "absent": None}[start]
        if whose == "launcher":
            describe(folder, port, launcher_pid=bystander.pid, launcher_started=recorded)
        else:
            describe(folder, port, pid=bystander.pid, started=recorded)
        main(["stop", "--port", str(port), "--timeout-s", "1"])
        time.sleep(0.3)
        assert bystander.poll() is None, "stop signalled a process that is not vramguard"
    finally:
        holder.kill()
        holder.wait()
    capsys.readouterr()


FOLLOWER = """
import sys, time, psutil
server = psutil.Process(int(sys.argv[1]))
print("following", flush=True)
while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
    time.sleep(0.05)
"""


def follower(server_pid: int) -> subprocess.Popen[str]:
    """A launcher whose tray quits by itself once its server has gone, as the real one
    does after a stop."""
    process = subprocess.Popen([sys.executable, "-c", FOLLOWER, str(server_pid)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "following"
    return process


@pytest.mark.parametrize("quits_by_itself", [True, False])
def test_stop_ends_the_server_first_and_the_launcher_only_if_it_stays(
        tmp_path, monkeypatch, capsys, bystander, quits_by_itself):
    """Issue 27: ending the launcher first (TerminateProcess on Windows) left a ghost
    icon. The server goes first, a stop request left for its tray, which then quits by
    itself; a launcher still there after the grace is ended, after the server."""
    from app.cli import process_control

    token_file = tmp_path / "config" / "admin-token"
    monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(token_file))
    monkeypatch.setattr(process_control, "LAUNCHER_GRACE_S", 1.0)
    folder = instance_folder(token_file)
    port = free_port()
    holder = hold(folder, port)
    launcher = follower(holder.pid) if quits_by_itself else bystander
    ended: list[int] = []
    terminate = psutil.Process.terminate

    def recording(process: psutil.Process) -> None:
        ended.append(process.pid)
        terminate(process)

    monkeypatch.setattr(psutil.Process, "terminate", recording)
    try:
        describe(folder, port, launcher_pid=launcher.pid,
                 launcher_started=psutil.Process(launcher.pid).create_time())
        assert main(["stop", "--port", str(port), "--timeout-s", "1"]) == 0
        assert ended == ([holder.pid] if quits_by_itself else [holder.pid, bystander.pid])
        assert launcher.wait(5) is not None
        assert stop_requested(folder, port, since=time.time() - 60)
    finally:
        holder.kill()
        holder.wait()
        if launcher is not bystander:
            launcher.kill()
            launcher.wait()
    capsys.readouterr()


def test_the_lock_is_unlocked_before_its_handle_closes_on_windows(tmp_path, monkeypatch):
    """msvcrt exists only on Windows: a stand-in records the calls, in order."""
    import app.host.instance as instance

    calls: list[str] = []

    class Msvcrt:
        LK_NBLCK, LK_UNLCK = 2, 0

        def locking(self, fd: int, mode: int, size: int) -> None:
            calls.append({2: "lock", 0: "unlock"}[mode])

    close = os.close
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(instance, "msvcrt", Msvcrt(), raising=False)
    monkeypatch.setattr(instance.os, "close", lambda fd: calls.append("close") or close(fd))
    lock = InstanceLock(tmp_path / "run", 8765)
    assert lock.acquire("http://127.0.0.1:8765")
    calls.clear()
    lock.release()
    assert calls == ["unlock", "close"]


def test_describing_the_lock_waits_out_an_antivirus(tmp_path, monkeypatch):
    import app.host.instance as instance

    refused: list[str] = []
    replace = os.replace

    def held_briefly(source: str, target: object) -> None:
        if len(refused) < 2:
            refused.append(source)
            raise PermissionError(13, "held by another program")
        replace(source, target)

    monkeypatch.setattr(instance.os, "replace", held_briefly)
    lock = InstanceLock(tmp_path / "run", 8765)
    assert lock.acquire("http://127.0.0.1:8765")
    assert len(refused) == 2 and lock.info_path.is_file()
    lock.release()


def test_a_description_another_program_holds_open_never_keeps_the_lock(
        tmp_path, monkeypatch, caplog):
    """Issue 27: on Windows, removing a file another program has open raises
    PermissionError (here a stand-in raises it: POSIX removes open files). It is tried
    again, then logged; the lock is released whatever happens, so the next server on this
    port can start."""
    from pathlib import Path

    lock = InstanceLock(tmp_path, 8765)
    assert lock.acquire("http://127.0.0.1:8765")
    tries: list[Path] = []
    real_unlink = Path.unlink

    def held_open(path: Path, missing_ok: bool = False) -> None:
        if path == lock.info_path:
            tries.append(path)
            raise PermissionError(13, "The process cannot access the file because it is "
                                      "being used by another process")
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", held_open)
    with caplog.at_level("WARNING", logger="vramguard"):
        lock.release()
    assert len(tries) > 1 and "could not remove" in caplog.text
    assert not is_held(tmp_path, 8765)
    monkeypatch.undo()
    following = InstanceLock(tmp_path, 8765)  # the next server on this port
    assert following.acquire("http://127.0.0.1:8765")
    following.release()
