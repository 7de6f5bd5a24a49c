"""The forward pass's CPU threads: whichever of "all" and "one fewer" its recent batches
measured faster, with the other tried now and then; lone images and those while other
images are read, decoded or queued judged apart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from app.engine.cpu_threads import EXPLORE_EVERY, TRIED, CpuThreads


@pytest.fixture
def threads() -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def busy_batches(fitted: CpuThreads, count: int, seconds: dict[int, float],
                 model: str = "m", images: int = 4, busy: bool = True) -> list[int]:
    """Run ``count`` busy (or lone) batches whose time depends only on the thread count."""
    used = []
    for _ in range(count):
        wanted = fitted.fit(busy, model, images)
        assert torch.get_num_threads() == wanted
        fitted.record(seconds[wanted])
        used.append(wanted)
    return used


def test_a_lone_image_on_a_quiet_computer_gets_every_thread_once_measured(
        threads: int) -> None:
    used = busy_batches(CpuThreads(), 2 * TRIED + EXPLORE_EVERY,
                        {threads - 1: 0.028, threads: 0.023}, images=1, busy=False)
    assert used[:2 * TRIED].count(threads - 1) == TRIED  # one fewer tried first
    assert used[2 * TRIED:].count(threads) >= EXPLORE_EVERY - 1


def test_a_lone_image_on_a_busy_computer_gets_one_fewer(threads: int) -> None:
    """Another program keeps a core busy: a pass on every core waits for it at each step."""
    used = busy_batches(CpuThreads(), 2 * TRIED + EXPLORE_EVERY,
                        {threads - 1: 0.1, threads: 1.0}, images=1, busy=False)
    assert used[0] == threads - 1
    assert used[2 * TRIED:].count(threads - 1) >= EXPLORE_EVERY - 1


def test_lone_and_busy_batches_are_judged_apart(threads: int) -> None:
    fitted = CpuThreads()
    busy_batches(fitted, 2 * TRIED + 1, {threads - 1: 0.1, threads: 0.05}, images=1)
    assert fitted.fit(False, "m", 1) == threads - 1  # lone: nothing measured yet
    fitted.record(0.2)


def test_measuring_while_serving_takes_one_fewer(threads: int) -> None:
    fitted = CpuThreads()
    fitted.for_measuring_while_serving()
    assert torch.get_num_threads() == threads - 1 and fitted.trial is None


def test_a_busy_server_tries_one_fewer_first_then_both(threads: int) -> None:
    used = busy_batches(CpuThreads(), 2 * TRIED, {threads - 1: 0.1, threads: 0.1})
    assert used[0] == threads - 1
    assert sorted(used) == [threads - 1] * TRIED + [threads] * TRIED


def test_every_thread_wins_when_it_is_faster_and_one_fewer_keeps_being_tried(
        threads: int) -> None:
    used = busy_batches(CpuThreads(), 2 * TRIED + 5 * EXPLORE_EVERY,
                        {threads - 1: 0.12, threads: 0.08})[2 * TRIED:]
    assert used.count(threads - 1) == 5  # one batch in EXPLORE_EVERY
    assert used.count(threads) == 5 * EXPLORE_EVERY - 5


def test_one_fewer_wins_under_heavy_competition(threads: int) -> None:
    used = busy_batches(CpuThreads(), 2 * TRIED + 3 * EXPLORE_EVERY,
                        {threads - 1: 0.1, threads: 0.3})[2 * TRIED:]
    assert used.count(threads) == 3
    assert used.count(threads - 1) == 3 * EXPLORE_EVERY - 3


def test_the_choice_follows_a_change_in_load(threads: int) -> None:
    fitted = CpuThreads()
    busy_batches(fitted, 2 * TRIED + EXPLORE_EVERY, {threads - 1: 0.1, threads: 0.05})
    assert fitted.fit(True, "m", 4) == threads
    fitted.record(0.05)
    # The machine gets busy: every core now stalls; the explored batches notice.
    used = busy_batches(fitted, 6 * EXPLORE_EVERY, {threads - 1: 0.1, threads: 0.4})
    assert used[-2 * EXPLORE_EVERY:].count(threads - 1) == 2 * EXPLORE_EVERY - 2


def test_models_and_batch_sizes_are_judged_apart(threads: int) -> None:
    fitted = CpuThreads()
    busy_batches(fitted, 2 * TRIED + 1, {threads - 1: 0.1, threads: 0.05}, images=4)
    # A batch of 8 or another model has no times of its own yet: it starts from scratch.
    assert fitted.fit(True, "m", 8) == threads - 1
    fitted.record(0.2)
    assert fitted.fit(True, "other", 4) == threads - 1
    fitted.record(None)  # an out-of-memory recovery split it: not a time to learn from
    assert ("other", 4, threads - 1, True) not in fitted.times
    assert len(fitted.times[("m", 8, threads - 1, True)]) == 1


def test_one_thread_stays_one() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fitted = CpuThreads()
        assert fitted.fit(True, "m", 4) == 1 == torch.get_num_threads()
        fitted.record(0.1)
        assert fitted.times == {}
    finally:
        torch.set_num_threads(before)
