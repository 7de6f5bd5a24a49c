"""The trial load: a folder's model built and checked in a child process first.

TorchScript, ``.pt2`` and ONNX files are programs, and any weights file may be crafted
to make a loader take all the memory or all the time there is. So before anything of a
folder is loaded into the server (or copied in by ``vramguard models add``), a spawned
child process describes it, builds it on the CPU and runs ``check_model``, under a time
limit and a memory limit, after checking that the computer has the memory the load
needs: an ONNX model takes about twice its size again while it converts. The child is
killed when it passes either limit, and the folder is refused with what happened.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import psutil

from app.models.own.manifest import FolderError

BASE_BYTES = 600 * 2**20  # a child with torch imported and one small model (measured ~450)
GROWTH = {"onnx": 3.0}  # the file, its parse and the converted copy at once
DEFAULT_GROWTH = 2.0  # the file read, and the module built from it
POLL_S = 0.05


@dataclass(frozen=True)
class TrialResult:
    """A folder that passed: its model's output size per image, and what loading took."""

    outputs: int
    seconds: float
    peak_bytes: int


def folder_bytes(folder: Path) -> int:
    """The size of the folder's regular files (links not followed)."""
    return sum(p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and not p.is_symlink())


def memory_needed(folder: Path, form: str) -> int:
    """What the trial (and a load) is expected to take of the computer's memory."""
    return BASE_BYTES + int(GROWTH.get(form, DEFAULT_GROWTH) * folder_bytes(folder))


def _child(folder: str, reply: Connection) -> None:
    """In the child: describe, build, check; send ("ok", outputs) or ("error", text)."""
    try:
        import torch

        torch.set_num_threads(1)
        from app.models.own.builders import build
        from app.models.own.checks import check_model
        from app.models.own.description import describe_folder

        described = describe_folder(Path(folder))
        module = build(Path(folder), described)
        reply.send(("ok", check_model(module, described).outputs))
    except FolderError as exc:
        reply.send(("error", str(exc)))
    except MemoryError:
        reply.send(("error", "The model took more memory than the computer has"))
    except BaseException as exc:
        reply.send(("error", f"Loading the model failed: {type(exc).__name__}: {exc}"[:400]))


def _rss(process: psutil.Process) -> int:
    try:
        return int(process.memory_info().rss)
    except psutil.Error:
        return 0


def run_trial(folder: Path, form: str, *, timeout_s: float,
              available: Callable[[], int] = lambda: int(psutil.virtual_memory().available)
              ) -> TrialResult:
    """Build and check ``folder``'s model in a child; FolderError when it fails, runs out
    of time, or would need more memory than the computer has free."""
    needed = memory_needed(folder, form)
    free = available()
    if needed > free:
        raise FolderError(f"Loading this model needs about {needed / 2**30:.1f} GiB of the "
                          f"computer's memory and only {free / 2**30:.1f} GiB is free; close "
                          "other programs and try again")
    limit = min(free, 2 * needed)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(str(folder), send), daemon=True)
    started = time.monotonic()
    child.start()
    send.close()
    watched = psutil.Process(child.pid)
    peak = 0
    try:
        while not receive.poll(POLL_S):
            peak = max(peak, _rss(watched))
            if peak > limit:
                raise FolderError(f"Loading the model took more than {limit / 2**30:.1f} "
                                  "GiB of memory, so it was stopped")
            if time.monotonic() - started > timeout_s:
                raise FolderError(f"Loading the model took longer than {timeout_s:.0f} s, "
                                  "so it was stopped")
            if not child.is_alive() and not receive.poll():
                raise FolderError(f"Loading the model crashed its process (exit code "
                                  f"{child.exitcode})")
        try:
            kind, value = receive.recv()
        except EOFError:
            raise FolderError("Loading the model crashed its process") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        receive.close()
    if kind != "ok":
        raise FolderError(str(value))
    return TrialResult(int(value), time.monotonic() - started, peak)
