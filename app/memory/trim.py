"""Give the C heap's free pages back to the operating system (glibc's ``malloc_trim``).

glibc keeps what a program frees inside its arenas (the main heap and one per thread
that allocates, up to 8 per core) and hands back to the system only what lies at the
top of one. A forward pass at warmup's largest batch, or a burst of decodes on the CPU
pool's threads, leaves tens to hundreds of MiB resident after every tensor is gone:
``malloc_trim(0)`` walks every arena and releases each free page wherever it lies.

Elsewhere this is a no-op that says so (None): Windows has no such call (its heap
decommits freed pages by its own rules), macOS's libmalloc has no ``malloc_trim``,
and musl has none either (its allocator returns freed spans to the system itself).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from the C library the process already uses, or None
    where there is none (looked up on every call: a dlsym, microseconds)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl, or a C library without the symbol
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    call: Callable[[int], int] = trim
    return call


def trim_heap() -> bool | None:
    """Release the free pages of every arena: whether any were released, None where
    the C library cannot (see the module's docstring). For processes that must stay
    light (the decode workers): it needs nothing beyond ctypes."""
    trim = _malloc_trim()
    if trim is None:
        return None
    return bool(trim(0))


def give_back_to_os() -> int | None:
    """``trim_heap``, measured: bytes of resident memory released (0 when nothing was
    free, or when other threads allocated as much meanwhile), None where not available.

    It takes time in proportion to what it gives back (130 ms for 200 MiB in 6,000 holes
    on the 2-core test machine; under a millisecond when little is free), and pages
    given back must be faulted in again when next used: call it when work has paused
    (after warmup, at an idle release), never per request."""
    if _malloc_trim() is None:
        return None
    import psutil  # only here: trim_heap's callers need no psutil

    process = psutil.Process()
    before = process.memory_info().rss
    trim_heap()
    return max(0, before - process.memory_info().rss)
