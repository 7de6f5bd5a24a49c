"""``give_back_to_os``: freed heap pages go back to the system where glibc can do it, and
it is a harmless no-op where it cannot."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

import numpy as np
import psutil
import pytest
import torch

from app.memory import trim
from app.memory.trim import give_back_to_os, trim_heap

MIB = 1024**2
BLOCK = 32 * 1024  # under glibc's mmap threshold: served from an arena, never mmapped
KEEP_EVERY = 64  # one block in 64 stays alive, so no arena's top is free to shrink


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _fragment_a_thread_arena(total: int) -> list[object]:
    """Fill a thread's arena with ``total`` bytes of small Python, numpy and torch blocks,
    free all but one in ``KEEP_EVERY``, and return the survivors: the freed pages lie
    between live blocks, where glibc keeps them until malloc_trim."""
    survivors: list[object] = []

    def work() -> None:
        makers = (lambda: bytearray(BLOCK), lambda: np.ones(BLOCK // 8),
                  lambda: torch.ones(BLOCK // 4))
        blocks = [makers[i % 3]() for i in range(total // BLOCK)]
        survivors.extend(blocks[::KEEP_EVERY])
        blocks.clear()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return survivors


@pytest.mark.skipif(trim_heap() is None, reason="no malloc_trim (not glibc)")
def test_freed_small_blocks_of_a_thread_arena_go_back_to_the_system() -> None:
    give_back_to_os()  # start from a trimmed heap
    before = _rss()
    survivors = _fragment_a_thread_arena(200 * MIB)
    held = _rss() - before
    # Freeing alone gives (almost) nothing back: otherwise this test proves nothing.
    assert held > 150 * MIB, f"glibc gave back the freed blocks itself ({held / MIB:.0f} MiB held)"

    released = give_back_to_os()

    assert released is not None and released > 100 * MIB, released
    assert _rss() - before < held - 100 * MIB
    del survivors  # alive until here: the pages given back lay between them


def test_nothing_to_trim_releases_nothing_much() -> None:
    give_back_to_os()
    released = give_back_to_os()
    assert released is None or released < 16 * MIB


class _NoTrim:
    """A C library without malloc_trim (musl): looking it up raises AttributeError."""

    def __init__(self, name: object) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        raise AttributeError(name)


def _no_library(name: object) -> object:
    raise OSError("no C library to open")


@pytest.mark.parametrize("cdll", [_NoTrim, _no_library], ids=["no-symbol", "no-library"])
def test_without_malloc_trim_it_is_a_harmless_no_op(monkeypatch: pytest.MonkeyPatch,
                                                    cdll: Callable[[object], object]) -> None:
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    assert trim_heap() is None
    assert give_back_to_os() is None


@pytest.mark.parametrize("platform", ["win32", "darwin"])
def test_other_systems_are_not_asked(monkeypatch: pytest.MonkeyPatch, platform: str) -> None:
    called: list[object] = []
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: called.append(name))
    assert give_back_to_os() is None
    assert trim._malloc_trim() is None
    assert called == []
