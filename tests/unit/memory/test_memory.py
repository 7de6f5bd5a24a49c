"""Memory accounting with numbers: fit, budget, admission, watermarks, tracker, recovery."""

from __future__ import annotations

import threading

import pytest
import torch

from app.engine.oom import OomRecovery
from app.engine.predictor import Prediction, Ranked
from app.errors import InsufficientMemory
from app.memory.budget import Budget
from app.memory.fit import MemoryFit, fit_linear
from app.memory.guard import GuardState, MemoryGuard
from app.memory.nvml import Nvml
from app.memory.probes import CpuProbe
from app.memory.tracker import LiveTensorTracker
from app.units import human_bytes

GiB, MiB = 1024**3, 1024**2


def test_fit_recovers_c_and_k():
    points = [(b, 300 * MiB + 40 * MiB * b) for b in (1, 2, 4, 8)]
    assert fit_linear(points) == MemoryFit(300 * MiB, 40 * MiB)


def test_fit_with_noise_stays_close():
    points = [(1, 341 * MiB), (2, 379 * MiB), (4, 462 * MiB), (8, 619 * MiB)]
    fit = fit_linear(points)
    assert abs(fit.bytes_per_sample - 40 * MiB) < 2 * MiB
    assert abs(fit.fixed_bytes - 300 * MiB) < 5 * MiB


@pytest.mark.parametrize("points", [[(4, 400)], [(1, 500), (2, 400)], [(1, 100), (2, 350)]])
def test_degenerate_fits_never_underestimate_a_measured_point(points):
    fit = fit_linear(points)
    assert all(fit.peak(size) >= peak for size, peak in points)


@pytest.mark.parametrize("points", [
    [(1, 341 * MiB), (2, 379 * MiB), (4, 462 * MiB), (8, 619 * MiB)],  # noise
    # cuDNN picks another algorithm at a large size and its workspace jumps
    [(1, 40 * MiB), (2, 80 * MiB), (4, 160 * MiB), (8, 320 * MiB), (32, 1900 * MiB)],
    [(1, 300 * MiB), (2, 340 * MiB), (4, 420 * MiB), (8, 580 * MiB), (16, 1400 * MiB)],
])
def test_the_fit_is_an_upper_bound_at_every_measured_point(points):
    """Least squares puts some points above its line; the guard must never plan for less
    than a batch was seen to need."""
    fit = fit_linear(points)
    assert all(fit.peak(size) >= peak for size, peak in points)
    assert fit.peak(1) < points[-1][1]  # still a line, not the worst point everywhere


def test_budget_worked_example():
    budget = Budget(total=24 * GiB, fraction=0.7, weights=4 * GiB, overhead=2 * GiB)
    assert budget.bytes == int(24 * GiB * 0.7) - 6 * GiB
    assert human_bytes(budget.bytes) == "10.8 GiB"
    text = "\n".join(budget.lines())
    assert "24.0 GiB" in text and "0.70" in text and "4.0 GiB" in text and "10.8 GiB" in text


def test_budget_cap_and_floor():
    # The cap limits the weights and the images in flight together: 5 GiB - 4 GiB.
    assert Budget(24 * GiB, 0.7, 4 * GiB, 2 * GiB, cap=5 * GiB).bytes == 1 * GiB
    assert Budget(8 * GiB, 0.7, 4 * GiB, 3 * GiB).bytes == 0


def guard(budget: int = 1000 * MiB, c: int = 100 * MiB, k: int = 50 * MiB,
          max_batch: int = 32) -> MemoryGuard:
    return MemoryGuard(Budget(budget, 1.0, 0, 0), MemoryFit(c, k), max_batch=max_batch)


def test_admission_arithmetic():
    g = guard()  # high watermark 900 MiB
    assert g.max_batch_now(in_use=0) == (900 - 100) // 50 == 16
    assert g.max_batch_now(in_use=400 * MiB) == (900 - 400 - 100) // 50 == 8
    assert g.max_batch_now(in_use=760 * MiB) == 0  # 40 MiB left: not one image fits
    assert guard(max_batch=4).max_batch_now(in_use=0) == 4


def test_budget_shrinks_for_others_and_never_grows_past_the_configured_one():
    g = guard()
    g.shrink_for_others(400 * MiB)
    assert g.budget_bytes == 600 * MiB and g.max_batch_now(0) == (540 - 100) // 50
    g.shrink_for_others(-300 * MiB)  # others now use less than at start
    assert g.budget_bytes == 1000 * MiB
    g.shrink_for_others(5000 * MiB)
    assert g.budget_bytes == 0 and g.max_batch_now(0) == 0


def test_watermarks_have_hysteresis():
    g = guard()  # low 750 MiB, high 900 MiB
    seen = [g.observe(usage * MiB) for usage in (100, 760, 910, 800, 760, 740, 100)]
    assert seen == [GuardState.OK, GuardState.HIGH, GuardState.SHEDDING, GuardState.SHEDDING,
                    GuardState.SHEDDING, GuardState.OK, GuardState.OK]
    assert g.counters.state_changes == 3


def test_shedding_means_one_image_at_a_time():
    g = guard()
    g.observe(950 * MiB)
    assert g.state is GuardState.SHEDDING and g.max_batch_now(0) == 1


def test_zero_budget_is_shedding():
    g = guard()
    g.shrink_for_others(2000 * MiB)
    assert g.observe(0) is GuardState.SHEDDING


def test_oom_halves_what_fits_and_relax_forgets():
    g = guard()
    assert g.max_batch_now(0) == 16
    g.on_oom(16, in_use=0)
    assert g.max_batch_now(0) == 8 and g.counters.oom_events == 1
    g.on_oom(1, in_use=0)
    assert g.max_batch_now(0) == 1  # a single image is still tried
    g.relax()
    assert g.max_batch_now(0) == 16


def test_tracker_counts_live_bytes_and_enforces_its_cap():
    tracker = LiveTensorTracker(cap=6_000_000, base=1_000_000)
    with tracker:
        a = torch.ones(1000, 1000)  # 4 MB
        assert tracker.live == 4_000_000 and tracker.base == 1_000_000
        with pytest.raises(torch.OutOfMemoryError):
            a + 1  # another 4 MB would pass the cap
    del a
    assert tracker.live == 0 and tracker.peak == 4_000_000


def test_tracker_sees_only_its_own_thread():
    tracker = LiveTensorTracker()
    kept = []
    with tracker:
        worker = threading.Thread(target=lambda: kept.append(torch.ones(1000, 1000)))
        worker.start()
        worker.join()
        mine = torch.ones(10, 10)
    assert tracker.live == 400 and mine.numel() == 100


def test_nvml_absent_is_not_an_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert Nvml.open() is None


def test_cpu_probe_reads_system_memory():
    reading = CpuProbe(weights=123).read()
    assert reading.device == "cpu" and reading.total > reading.free > 0
    assert reading.allocated == reading.reserved == 123


class FakeForward:
    """Fails like a full GPU for batches larger than ``fits``."""

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.sizes: list[int] = []

    def __call__(self, samples: list[int]) -> list[Prediction]:
        self.sizes.append(len(samples))
        if len(samples) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        ranked = Ranked(torch.zeros(1).numpy(), torch.ones(1).numpy())
        return [Prediction(ranked, len(samples)) for _ in samples]


def test_recovery_splits_until_the_halves_fit():
    g = guard()
    forward = FakeForward(fits=2)
    outcomes = OomRecovery(forward, g, CpuProbe(weights=0))(list(range(8)))
    assert all(isinstance(o, Prediction) and o.batch_size == 2 for o in outcomes)
    assert len(outcomes) == 8 and forward.sizes == [8, 4, 2, 2, 4, 2, 2]
    assert (g.counters.oom_events, g.counters.oom_recoveries, g.counters.oom_failures) == (3, 3, 0)


def test_a_single_image_that_does_not_fit_gets_503():
    g = guard()
    outcomes = OomRecovery(FakeForward(fits=0), g, CpuProbe(weights=0))([1, 2])
    assert all(isinstance(o, InsufficientMemory) and o.status == 503 for o in outcomes)
    assert g.counters.oom_failures == 2 and g.counters.oom_recoveries == 0
