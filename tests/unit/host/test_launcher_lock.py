"""The launcher lock (issue 27, item 4): one `vramguard run` per port while it starts, and
the note a second launch leaves for the first one's tray. The lock is held by another
process where it matters, as a second double-click's launcher would be."""

from __future__ import annotations

import subprocess
import sys
import time

from app.host.launcher_lock import LauncherLock, leave_note


def test_one_launcher_holds_it_and_a_second_is_refused(tmp_path):
    first, second = LauncherLock(tmp_path / "run", 8765), LauncherLock(tmp_path / "run", 8765)
    assert first.acquire()
    assert not second.acquire()
    assert LauncherLock(tmp_path / "run", 8766).acquire()  # another port is another lock
    first.release()
    assert second.acquire()
    second.release()


def test_the_lock_dies_with_its_process(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from app.host.launcher_lock import LauncherLock; "
         f"assert LauncherLock(Path({str(folder)!r}), 8765).acquire(); print('held', "
         "flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert not LauncherLock(folder, 8765).acquire()
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 5
    lock = LauncherLock(folder, 8765)
    while not lock.acquire():
        assert time.monotonic() < deadline, "a killed launcher's lock was not released"
        time.sleep(0.05)
    lock.release()


def test_a_second_launch_leaves_one_note_taken_once(tmp_path):
    lock = LauncherLock(tmp_path / "run", 8765)
    assert lock.acquire()
    assert not lock.launched_again()
    leave_note(tmp_path / "run", 8765)
    leave_note(tmp_path / "run", 8765)  # twice says the same
    assert lock.launched_again()
    assert not lock.launched_again()
    lock.release()


def test_a_note_left_for_an_earlier_launcher_is_not_read_by_the_next(tmp_path):
    (tmp_path / "run").mkdir(mode=0o700)
    leave_note(tmp_path / "run", 8765)
    lock = LauncherLock(tmp_path / "run", 8765)
    assert lock.acquire()
    assert not lock.launched_again()
    lock.release()


def test_the_note_is_never_written_through_a_link(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    target = tmp_path / "someone-elses-file"
    (folder / "launched-again-8765").symlink_to(target)
    leave_note(folder, 8765)  # the link is there: it says the same, and nothing is written
    assert not target.exists()
