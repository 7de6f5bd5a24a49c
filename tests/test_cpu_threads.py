"""The forward pass's CPU threads: all of them for a lone image, one fewer while other
images are read, decoded or queued (they compete for the same cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from app.engine.cpu_threads import CpuThreads


@pytest.fixture
def threads() -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def test_a_lone_image_gets_every_thread_and_a_busy_server_one_fewer(threads: int) -> None:
    fitted = CpuThreads()
    assert fitted.fit(others_busy=True) == threads - 1 == torch.get_num_threads()
    assert fitted.fit(others_busy=True) == threads - 1
    assert fitted.fit(others_busy=False) == threads == torch.get_num_threads()


def test_one_thread_stays_one() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert CpuThreads().fit(others_busy=True) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
