"""The claims folder where vramguards on one GPU find each other: real processes play the
other servers; the folder's contents are input from other users, so links, large files,
broken ones and process numbers used again do not count."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import pytest

from app.host.gpu_claims import MAX_CLAIM_BYTES, MAX_CLAIMS, Claim, GpuClaims

GPU = "GPU-0b5c5c1e"


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen[bytes]]:
    """A real process standing for another user's vramguard."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def write_claim(folder: Path, pid: int, **changes: object) -> Path:
    """A claim as another server writes it: its real start time unless changed."""
    claim = Claim(pid=pid, started=psutil.Process(pid).create_time(), port=8766, gpu=GPU,
                  token="ab" * 8)
    path = folder / f"{pid}-{claim.token}.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(replace(claim, **changes))))  # type: ignore[arg-type]
    return path


def test_a_live_server_is_seen_and_a_stopped_ones_claim_is_removed(tmp_path, other_process):
    folder = tmp_path / "gpus"
    mine = GpuClaims(folder, GPU, 8765)
    mine.claim()
    path = write_claim(folder, other_process.pid)
    assert [(c.pid, c.port) for c in mine.others()] == [(other_process.pid, 8766)]
    other_process.kill()
    other_process.wait()
    assert mine.others() == []
    assert not path.exists()
    assert mine.path.exists()  # its own stays while it runs
    mine.release()
    assert not mine.path.exists()


def test_two_servers_see_each_other_and_not_themselves(tmp_path, other_process):
    folder = tmp_path / "gpus"
    first = GpuClaims(folder, GPU, 8765)
    second = GpuClaims(folder, GPU, 8766, pid=other_process.pid)
    first.claim()
    second.claim()
    assert [c.port for c in first.others()] == [8766]
    assert [c.port for c in second.others()] == [8765]


def test_a_process_counts_once_and_this_process_not_at_all(tmp_path, other_process):
    """Engines in one process share its one allocator limit (the GPU check makes
    several); several claims for one process, or a file named for another, are one."""
    folder = tmp_path / "gpus"
    GpuClaims(folder, GPU, 8766).claim()  # another engine of this process
    text = write_claim(folder, other_process.pid).read_text()
    (folder / f"{other_process.pid}-{'cd' * 8}.json").write_text(text)  # a second claim
    (folder / f"1-{'ef' * 8}.json").write_text(text)  # named for another process
    assert len(list(folder.glob("*.json"))) == 4
    assert [c.pid for c in GpuClaims(folder, GPU, 8765).others()] == [other_process.pid]


def test_a_file_that_breaks_the_json_reader_is_ignored(tmp_path):
    folder = tmp_path / "gpus"
    folder.mkdir()
    (folder / f"77-{'ab' * 8}.json").write_text("[" * 1000)  # RecursionError in json
    assert GpuClaims(folder, GPU, 8765).others() == []


def test_a_process_number_given_to_another_program_does_not_count(tmp_path, other_process):
    folder = tmp_path / "gpus"
    write_claim(folder, other_process.pid, started=psutil.Process(other_process.pid)
                .create_time() - 3600)  # the server that wrote it started an hour earlier
    assert GpuClaims(folder, GPU, 8765).others() == []


def test_another_gpus_servers_do_not_count(tmp_path, other_process):
    folder = tmp_path / "gpus"
    write_claim(folder, other_process.pid, gpu="GPU-ffffffff")
    assert GpuClaims(folder, GPU, 8765).others() == []


def test_links_large_broken_and_misnamed_files_are_not_read(tmp_path, other_process):
    folder = tmp_path / "gpus"
    real = write_claim(folder, other_process.pid)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(real.read_text())
    real.unlink()
    (folder / f"{other_process.pid}-{'cd' * 8}.json").symlink_to(outside)
    large = json.loads(outside.read_text()) | {"padding": "x" * MAX_CLAIM_BYTES}
    (folder / f"{other_process.pid}-{'ef' * 8}.json").write_text(json.dumps(large))
    (folder / f"{other_process.pid}-{'01' * 8}.json").write_text("{not json")
    (folder / f"{other_process.pid}-{'23' * 8}.json").write_text('{"pid": "x"}')
    (folder / "notes.json").write_text(outside.read_text())
    (folder / f"{other_process.pid}-{'45' * 8}.json").mkdir()
    os.mkfifo(folder / f"{other_process.pid}-{'67' * 8}.json")  # would block an open
    for pid in (-5, 0, 2**70):  # numbers no process has: psutil raises ValueError for some
        write_claim(folder, other_process.pid).rename(folder / f"{abs(pid)}-{'89' * 8}.json")
        path = folder / f"{abs(pid)}-{'89' * 8}.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"pid": pid}))
        assert GpuClaims(folder, GPU, 8765).others() == []
    assert GpuClaims(folder, GPU, 8765).others() == []


def test_the_folder_is_made_for_every_user_and_a_link_in_its_place_is_refused(tmp_path):
    folder = tmp_path / "gpus"
    claims = GpuClaims(folder, GPU, 8765)
    claims.claim()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o1777
    assert stat.S_IMODE(claims.path.stat().st_mode) == 0o644
    assert claims.problem is None
    linked = tmp_path / "linked"
    linked.symlink_to(folder)
    refused = GpuClaims(linked, GPU, 8765)
    refused.claim()
    assert refused.problem and "is a link" in refused.problem
    assert not list(folder.glob(f"{os.getpid()}-{refused.own.token}*"))


def test_a_folder_others_may_write_without_the_sticky_bit_is_refused(tmp_path):
    """Without the sticky bit any user could remove this server's claim, and the others
    would plan for memory it uses: it writes none and says why (so it plans as alone)."""
    folder = tmp_path / "gpus"
    folder.mkdir()
    os.chmod(folder, 0o777)
    refused = GpuClaims(folder, GPU, 8765)
    refused.claim()
    assert refused.problem and "lacks the sticky bit" in refused.problem
    assert not refused.path.exists()
    os.chmod(folder, 0o1777)
    accepted = GpuClaims(folder, GPU, 8765)
    accepted.claim()
    assert accepted.problem is None and accepted.path.exists()


def test_claims_left_unread_are_logged_once(tmp_path, other_process, caplog):
    folder = tmp_path / "gpus"
    for n in range(MAX_CLAIMS + 1):
        write_claim(folder, other_process.pid).rename(folder / f"{n + 1}-{'ab' * 8}.json")
    claims = GpuClaims(folder, GPU, 8765)
    claims.others()
    claims.others()
    assert caplog.text.count("holds more files than vramguard reads") == 1
