"""Warmup's choice of batch size from measured latencies."""

from __future__ import annotations

import pytest
import torch
from cuda_messages import (
    CUBLAS_NOT_INITIALIZED,
    CUDNN_DEVICE_ALLOCATION_FAILED,
    cublas_error,
    cuda_runtime_error,
    cudnn_error,
)

from app.engine.warmup import (
    BatchTiming,
    WarmupTimings,
    batch_sizes,
    choose_batch_size,
    profile_steps,
    run_through,
)


def profile(*args: object, **kwargs: object) -> WarmupTimings:
    """Every step of the profile at once, as a load at start runs it."""
    return run_through(profile_steps(*args, **kwargs))  # type: ignore[arg-type]


def test_batch_sizes_double_up_to_the_maximum():
    assert batch_sizes(1) == [1]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]


def test_chooses_best_throughput_not_the_biggest_batch():
    # Shaped like EfficientNet-Lite0 on a 2-core CPU: per image, batch 8 is slower.
    timings = [BatchTiming(1, 0.030), BatchTiming(2, 0.050), BatchTiming(4, 0.085),
               BatchTiming(8, 0.240)]
    assert choose_batch_size(timings, target_latency_s=1.0) == 4


def test_near_ties_go_to_the_larger_batch():
    timings = [BatchTiming(1, 0.0256), BatchTiming(2, 0.0451), BatchTiming(4, 0.0909),
               BatchTiming(8, 0.2417)]  # 39.1, 44.3, 44.0, 33.1 images/s: measured here
    assert choose_batch_size(timings, target_latency_s=0.25) == 4
    clear_winner = [BatchTiming(2, 0.040), BatchTiming(4, 0.100)]  # 50 vs 40 images/s
    assert choose_batch_size(clear_winner, target_latency_s=0.25) == 2


def test_latency_target_caps_the_batch():
    timings = [BatchTiming(1, 0.010), BatchTiming(8, 0.040), BatchTiming(32, 0.120)]
    assert choose_batch_size(timings, target_latency_s=0.1) == 8
    assert choose_batch_size(timings, target_latency_s=0.005) == 1


def test_profile_stops_growing_past_the_target():
    tried: list[int] = []
    now = [0.0]

    def clock() -> float:
        return now[0]

    def run(size: int) -> None:
        tried.append(size)
        now[0] += size / 128  # exactly 1/128 s per image: every size has the same throughput

    result = profile(run, max_batch=64, target_latency_s=0.05, repeats=2, clock=clock,
                     build=lambda size: size)
    assert [t.batch_size for t in result.timings] == [1, 2, 4, 8]
    assert set(tried) == {1, 2, 4, 8}
    assert tried[-8:] == [1, 2, 4, 8, 1, 2, 4, 8]  # repeats go round-robin over the sizes
    assert result.chosen_batch_size == 4  # a tie goes to the largest size within the target
    assert result.timings[2].seconds == 4 / 128


def test_round_robin_repeats_cancel_a_slow_patch():
    """A machine that is slow for a while must not make one size look worse than it is."""
    now = [0.0]
    calls = [0]

    def clock() -> float:
        return now[0]

    def run(size: int) -> None:
        calls[0] += 1
        slow = 3.0 if 10 <= calls[0] < 16 else 1.0  # a slow patch in the middle
        now[0] += slow * 0.01 * size ** 0.8  # bigger batches are a bit cheaper per image

    result = profile(run, max_batch=8, target_latency_s=1.0, repeats=5, clock=clock,
                     build=lambda size: size)
    assert result.chosen_batch_size == 8


def test_throughput_at_a_batch_size_set_by_the_user():
    from app.engine.warmup import WarmupTimings

    warm = WarmupTimings([BatchTiming(1, 0.02), BatchTiming(2, 0.032), BatchTiming(4, 0.08)], 2)
    assert warm.images_per_second == 2 / 0.032
    assert warm.throughput_at(4) == 4 / 0.08  # a pinned size uses its own timing
    assert warm.throughput_at(8) == 4 / 0.08  # beyond what was timed: the largest timed
    assert warm.throughput_at(0) == 0.0


def test_building_inputs_is_not_timed():
    """Random inputs cost far more on the CPU than a GPU's forward pass: only the batch
    call itself may count."""
    now = [0.0]
    built: list[int] = []

    def build(size: int) -> int:
        built.append(size)
        now[0] += 1.0  # a builder far slower than the pass
        return size

    def run(size: int) -> None:
        now[0] += size / 128

    result = profile(run, max_batch=8, target_latency_s=0.5, repeats=2, clock=lambda: now[0],
                     build=build)
    assert [t.seconds for t in result.timings] == [1 / 128, 2 / 128, 4 / 128, 8 / 128]
    assert built == [1, 2, 4, 8]  # once per size, reused by every repeat


OOM_KINDS = {  # as the shipped CUDA libraries word them (tests/support/cuda_messages.py)
    "allocator": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
    "kernel launch": lambda: cuda_runtime_error(2),
    "cudnn": lambda: cudnn_error(CUDNN_DEVICE_ALLOCATION_FAILED),
    "cublas": lambda: cublas_error(CUBLAS_NOT_INITIALIZED, "cublasCreate(handle)"),
}


@pytest.mark.parametrize("kind", OOM_KINDS)
def test_an_oom_at_a_large_size_stops_the_growth(kind: str):
    now = [0.0]
    freed: list[int] = []

    def run(size: int) -> None:
        if size >= 8:
            raise OOM_KINDS[kind]()
        now[0] += size / 128

    result = profile(run, max_batch=64, target_latency_s=1.0, repeats=2, clock=lambda: now[0],
                     build=lambda size: size, free=lambda: freed.append(1))
    assert [t.batch_size for t in result.timings] == [1, 2, 4]
    assert result.chosen_batch_size == 4 and result.out_of_memory_at == 8
    assert freed == [1]


def test_other_errors_still_fail_the_warmup():
    def run(size: int) -> None:
        raise ValueError("a broken model")

    with pytest.raises(ValueError, match="broken"):
        profile(run, max_batch=8, target_latency_s=1.0, build=lambda size: size)


def test_an_oom_during_the_repeats_drops_that_size_and_the_larger_ones():
    """Another program took memory after the size was first timed."""
    now = [0.0]
    calls = {4: 0}
    freed: list[int] = []

    def run(size: int) -> None:
        if size == 4:
            calls[4] += 1
            if calls[4] > 2:  # fine while growing, then out of memory
                raise torch.AcceleratorError("CUDA error: out of memory")
        now[0] += size / 128

    result = profile(run, max_batch=8, target_latency_s=1.0, repeats=3, clock=lambda: now[0],
                     build=lambda size: size, free=lambda: freed.append(1))
    assert [t.batch_size for t in result.timings] == [1, 2]
    assert result.out_of_memory_at == 4 and result.chosen_batch_size == 2 and freed == [1]
