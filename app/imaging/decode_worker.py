"""The decode worker process: opens untrusted images away from the server process.

``app/imaging/decode_pool.py`` starts these with the spawn method and kills one whose image
takes too long (or that dies), so nothing a decoder does (loop for minutes, allocate gigabytes,
crash) reaches the server. This module is what a new worker imports: it must
not import torch (measured: 1.3 s of CPU and 660 MiB per worker), numpy (110 ms,
18 MiB) or the web stack.

The conversation, one image at a time, over a multiprocessing Pipe:
``(data, max_pixels, spec, granted_bytes)`` -> ``("plan", peak_bytes)`` -> ``True`` (go)
or ``False`` (refused) -> ``("done", the model's crop as RGB bytes)``. An image whose
predicted peak fits in ``granted_bytes`` (reserved by the server beforehand, enough for
an ordinary photo) skips the plan and its answer: one round trip instead of two. Any step
may answer ``("error", ApiError)`` for a bad image or ``("failed", text)`` for a bug, and
``None`` ends the worker.

After a large image (its upload and predicted peak together over ``TRIM_AFTER_BYTES``)
the worker gives its freed heap back to the system (``app/memory/trim.py``): glibc keeps
it otherwise, and a worker that had opened a 36 MB bitmap and then an 8 MiB PNG stayed
28 MiB larger for the rest of its life.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from app.errors import ApiError
from app.imaging.decoding import model_patch, open_image
from app.memory.trim import trim_heap
from app.preprocessing import Preprocessing

READY = "ready"
MIB = 1024**2
# An ordinary photo stays under this and costs no trim (a 12-megapixel JPEG: 2-4 MiB
# uploaded, 15-17 MiB predicted peak); trimming after each of those measured +1-2 % of
# its 31 ms decode and gave nothing back.
TRIM_AFTER_BYTES = 32 * MIB
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve(conn: Connection, memory_allowance: int | None) -> None:
    """The worker's main loop, until the server says stop or goes away."""
    _die_with_server()
    _cap_memory(memory_allowance)
    conn.send(READY)
    while True:
        try:
            job = conn.recv()
            if job is None:
                return
            used = _handle(conn, *job)
            del job  # the upload too, before the heap is trimmed
            if used > TRIM_AFTER_BYTES:
                trim_heap()
        except (EOFError, OSError):  # the pipe is closed: the server is gone
            return


def _handle(conn: Connection, data: bytes, max_pixels: int, spec: Preprocessing,
            granted_bytes: int) -> int:
    """One image; its pixels are freed when this returns, before the next. Returns the
    bytes it held at most: its upload and, once its header was read, its predicted peak."""
    try:
        opened = open_image(data, max_pixels, spec.resize)
    except Exception as error:
        conn.send(_failure(error))
        return len(data)
    used = len(data) + opened.peak_bytes
    if opened.peak_bytes > granted_bytes:
        conn.send(("plan", opened.peak_bytes))
        if not conn.recv():
            return len(data)
    answer: tuple[str, object]
    try:
        answer = ("done", model_patch(opened, spec))
    except Exception as error:
        answer = _failure(error)
    conn.send(answer)
    return used


def _failure(error: Exception) -> tuple[str, object]:
    """A bad image is the client's error; anything else is a decoder bug, which the server
    logs and answers with 500."""
    if isinstance(error, ApiError):
        return "error", error
    return "failed", f"{type(error).__name__}: {error}"


def _die_with_server() -> None:
    """On Linux, be killed when the server dies: a worker busy with a crafted image would
    otherwise notice only when that image is done, which may be never. Elsewhere it ends
    when it next reads from the closed pipe."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _cap_memory(allowance: int | None) -> None:
    """On Linux, let this process's address space grow by at most ``allowance`` bytes
    beyond what it holds now, so a decoder that asks for more gets MemoryError (or dies)
    instead of swelling; other systems rely on the predicted peak alone."""
    if allowance is None or not sys.platform.startswith("linux"):
        return
    import resource

    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + allowance
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
