"""Which vramguards run on each GPU of this computer: one small claim file per server, in a
folder every user of the computer can write to.

Two users on one PC (fast user switching), or one user on two ports, run two servers that
would each plan for ``memory_fraction`` of the same card. Each server on a GPU writes a
claim naming its process, when that process started, its port and the GPU, and reads the
others'. A claim counts while its process lives: the same process number *and* start
time, so a number the system has given to another program since does not count. A dead
server's claim is ignored, and removed where this user may.

The folder is input from other users: only regular files named like a claim are read (no
links), at most ``MAX_CLAIM_BYTES`` each and ``MAX_CLAIMS`` in all, among at most
``MAX_ENTRIES`` names (the log says once when the rest is left unread), and anything that
does not parse is ignored. A made-up claim can only make this server plan for less, which
a program that simply takes GPU memory does as well. The folder itself must be a real
folder, and one other users may write to must have the sticky bit (as /tmp has), or any
of them could remove this server's claim: otherwise this server writes none, plans as if
alone, and says why. (On Windows the folder's permissions are its ACLs, not its mode.)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

MAX_CLAIM_BYTES = 1024
MAX_CLAIMS = 64  # read at most this many claims
MAX_ENTRIES = 4096  # and look at most at this many names
CLAIM_NAME = re.compile(r"^[0-9]+-[0-9a-f]{16}\.json$")
START_TOLERANCE_S = 1.0  # process start times, as the system reports them, to the second


@dataclass(frozen=True)
class Claim:
    """One server on one GPU."""

    pid: int
    started: float  # the process's start time (seconds since the epoch)
    port: int
    gpu: str  # the device's identity: its UUID where CUDA gives one, else its PCI bus id
    token: str  # this server's, so two servers in one process are told apart


def process_started(pid: int) -> float | None:
    if pid <= 0:
        return None
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError, OverflowError):  # a number no process has
        return None


def is_alive(claim: Claim) -> bool:
    """The claim's process runs, and is the one that wrote it."""
    started = process_started(claim.pid)
    return started is not None and abs(started - claim.started) <= START_TOLERANCE_S


def read_claim(path: Path) -> Claim | None:
    """The claim in ``path``, or None for anything else (a link, a large or broken file)."""
    try:
        # O_NONBLOCK: a pipe named like a claim would block the open (and the memory
        # monitor with it) until someone wrote to it; regular files ignore the flag.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CLAIM_BYTES:
            return None
        text = os.read(fd, MAX_CLAIM_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(text)
        if not 0 < int(data["pid"]) < 2**31:
            return None
        claim = Claim(pid=int(data["pid"]), started=float(data["started"]),
                      port=int(data["port"]), gpu=str(data["gpu"])[:200],
                      token=str(data["token"])[:32])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None
    return claim


def folder_problem(info: os.stat_result) -> str | None:
    """Why a claims folder with this status cannot be trusted with this server's claim."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return ("may be written by other users but lacks the sticky bit, so any of them "
                "could remove this server's claim (chmod 1777 fixes it)")
    return None


class GpuClaims:
    """This server's claim on one GPU, and the live claims of the others on it."""

    def __init__(self, folder: Path, gpu: str, port: int, *, pid: int | None = None,
                 alive: Callable[[Claim], bool] = is_alive) -> None:
        self.folder = folder
        own_pid = os.getpid() if pid is None else pid
        self.own = Claim(pid=own_pid, started=process_started(own_pid) or 0.0, port=port,
                         gpu=gpu, token=secrets.token_hex(8))
        self._alive = alive
        self.path = folder / f"{own_pid}-{self.own.token}.json"
        self.problem: str | None = None  # why the claims could not be written or read
        self._told_unread = False

    def claim(self) -> None:
        """Write this server's claim (atomically); a folder that cannot be used is logged
        once and kept in ``problem``: the server then plans as if it were alone."""
        try:
            self._make_folder()
            partial = self.path.with_suffix(".part")
            partial.write_text(json.dumps(asdict(self.own)), encoding="utf-8")
            os.chmod(partial, 0o644)
            os.replace(partial, self.path)
        except OSError as exc:
            self.problem = f"could not write to {self.folder}: {exc.strerror or exc}"
            log.warning("other vramguards on this GPU cannot be seen: %s", self.problem)

    def _make_folder(self) -> None:
        if self.folder.is_symlink():
            raise OSError(f"{self.folder} is a link")
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # every user's servers write here
                os.chmod(self.folder, 0o1777)
        if os.name != "nt":
            unsafe = folder_problem(os.lstat(self.folder))
            if unsafe is not None:
                raise OSError(f"{self.folder} {unsafe}")

    def others(self) -> list[Claim]:
        """The other live servers on this GPU, the oldest first."""
        try:
            with os.scandir(self.folder) as listing:
                names = [e.name for e in itertools.islice(listing, MAX_ENTRIES)]
        except OSError:
            return []
        found: dict[int, Claim] = {}
        wanted = [n for n in names if CLAIM_NAME.match(n) and n != self.path.name]
        if (len(names) == MAX_ENTRIES or len(wanted) > MAX_CLAIMS) and not self._told_unread:
            self._told_unread = True
            log.warning("%s holds more files than vramguard reads (%d claims among %d "
                        "names): servers whose claims are left unread are not seen",
                        self.folder, MAX_CLAIMS, MAX_ENTRIES)
        for name in wanted[:MAX_CLAIMS]:
            claim = read_claim(self.folder / name)
            # One server per process, counted once: engines in this process share its
            # one allocator limit, and a name must agree with what the file says.
            if (claim is None or claim.gpu != self.own.gpu or claim.pid == self.own.pid
                    or claim.pid in found or not name.startswith(f"{claim.pid}-")):
                continue
            if self._alive(claim):
                found[claim.pid] = claim
            else:
                with contextlib.suppress(OSError):  # another user's stays: the sticky bit
                    os.unlink(self.folder / name)
        return sorted(found.values(), key=lambda c: (c.started, c.token))

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
