"""Every form CUDA's out-of-memory takes, and the errors that break the device for good,
raised as the real exception classes through the real OomRecovery and MicroBatcher.

On a GPU an allocation failure arrives as ``torch.OutOfMemoryError`` (the caching
allocator), as ``torch.AcceleratorError`` (a kernel launch or lazy module load), or as a
plain ``RuntimeError`` from cuDNN or cuBLAS. All of them must be split and retried; a
sticky error (the CUDA context is lost) must mark the engine failed instead.
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait

import pytest
import torch
from cuda_messages import (
    CUBLAS_ALLOC_FAILED,
    CUBLAS_NOT_INITIALIZED,
    CUDNN_DEVICE_ALLOCATION_FAILED,
    CUDNN_EXECUTION_FAILED_CUDA_DRIVER,
    CUDNN_HOST_ALLOCATION_FAILED,
    cublas_error,
    cuda_runtime_error,
    cudnn_error,
)
from cuda_standin import GiB, install_gpu
from tiny_model import tiny_model

from app.config import load_settings
from app.engine import oom
from app.engine.batcher import MicroBatcher
from app.engine.engine import InferenceEngine, Phase
from app.engine.oom import OomRecovery
from app.engine.predictor import Prediction, Ranked
from app.errors import InsufficientMemory, NotReady
from app.memory.budget import Budget
from app.memory.fit import MemoryFit
from app.memory.guard import MemoryGuard
from app.memory.probes import CpuProbe, CudaProbe

MiB = 1024**2

# The messages as torch 2.x words them, read from the CUDA libraries torch ships
# (tests/support/cuda_messages.py), as a GPU would print them.
OOM_ERRORS: dict[str, Callable[[], BaseException]] = {
    "allocator": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "kernel launch": lambda: cuda_runtime_error(2),
    "cudnn 9 device allocation": lambda: cudnn_error(CUDNN_DEVICE_ALLOCATION_FAILED),
    "cublas create": lambda: cublas_error(CUBLAS_NOT_INITIALIZED, "cublasCreate(handle)"),
    "cublas alloc": lambda: cublas_error(CUBLAS_ALLOC_FAILED, "cublasLtMatmul(...)"),
    # A JIT-compiled kernel allocating outside torch: the driver's error 2 is its OOM (the
    # detail's wording is cuDNN 9's last-error string, not in the library's tables).
    "cudnn jit kernel": lambda: cudnn_error(
        CUDNN_EXECUTION_FAILED_CUDA_DRIVER, "\ncuModuleLoadData failed with err 2"),
    "driver api": lambda: RuntimeError("CUDA driver error: CUDA_ERROR_OUT_OF_MEMORY"),
}
# Sticky: 700 illegal address, 719 launch failure, 710 device assert, 999 unknown (a GPU off
# the bus), 46 busy or unavailable, 100 no device, 709 context destroyed.
STICKY_ERRORS: dict[str, Callable[[], BaseException]] = {
    str(code): functools.partial(cuda_runtime_error, code)
    for code in (700, 719, 710, 999, 46, 100, 709)}


def guard() -> MemoryGuard:
    return MemoryGuard(Budget(1000 * MiB, 1.0, 0, 0), MemoryFit(100 * MiB, 50 * MiB),
                       max_batch=32)


class ScriptedForward:
    """A forward pass that fails with ``error()`` for batches larger than ``fits``."""

    def __init__(self, fits: int, error: Callable[[], BaseException]) -> None:
        self.fits = fits
        self.error = error
        self.sizes: list[int] = []

    def __call__(self, samples: list[int]) -> list[Prediction]:
        self.sizes.append(len(samples))
        if len(samples) > self.fits:
            raise self.error()
        ranked = Ranked(torch.zeros(1).numpy(), torch.ones(1).numpy())
        return [Prediction(ranked, len(samples)) for _ in samples]


@pytest.mark.parametrize("kind", OOM_ERRORS)
def test_every_kind_of_oom_is_classified_as_oom(kind: str) -> None:
    assert oom.classify_error(OOM_ERRORS[kind]()) is oom.ErrorKind.OUT_OF_MEMORY


@pytest.mark.parametrize("kind", STICKY_ERRORS)
def test_sticky_cuda_errors_are_classified_as_device_lost(kind: str) -> None:
    assert oom.classify_error(STICKY_ERRORS[kind]()) is oom.ErrorKind.DEVICE_LOST


@pytest.mark.parametrize("error", [RuntimeError("model exploded"), ValueError("out of memory"),
                                   lambda: cuda_runtime_error(1),  # invalid argument
                                   lambda: cudnn_error(CUDNN_EXECUTION_FAILED_CUDA_DRIVER)])
def test_other_errors_are_not_memory_errors(error: BaseException | Callable[[], BaseException]
                                            ) -> None:
    exc = error if isinstance(error, BaseException) else error()
    assert oom.classify_error(exc) is oom.ErrorKind.OTHER


def test_cudnn_out_of_the_computers_memory_is_not_the_gpus() -> None:
    """HOST_ALLOCATION_FAILED: every image of the batch gets 503 (try again later), no
    split, and the guard learns nothing about the GPU."""
    g = guard()
    fits_before = g.max_batch_now(0)
    forward = ScriptedForward(fits=0, error=lambda: cudnn_error(CUDNN_HOST_ALLOCATION_FAILED))
    outcomes = OomRecovery(forward, g, CpuProbe(weights=0))([1, 2, 3, 4])
    assert forward.sizes == [4]
    assert all(isinstance(o, InsufficientMemory) and "computer" in o.message
               and o.retry_after for o in outcomes)
    assert (g.counters.oom_events, g.max_batch_now(0)) == (0, fits_before)


NO_ENGINE = "GET was unable to find an engine to execute this computation"


def test_no_engine_after_swallowed_ooms_is_out_of_memory(monkeypatch) -> None:
    """cuDNN tried engines whose workspaces did not fit (the allocator counted the
    failures), then gave up: split and retry, as for any OOM."""
    cuda, _ = install_gpu(monkeypatch, total=8 * GiB)
    probe = CudaProbe(torch.device("cuda", 0), weights=0)

    def forward(samples: list[int]) -> list[Prediction]:
        if len(samples) > 2:
            cuda.limit = 0
            with pytest.raises(torch.OutOfMemoryError):  # what Conv_v8's try_configs eats
                cuda.alloc(GiB)
            cuda.limit = cuda.total
            raise RuntimeError(NO_ENGINE)
        return ScriptedForward(fits=2, error=RuntimeError)(samples)

    g = guard()
    outcomes = OomRecovery(forward, g, probe)([1, 2, 3, 4])
    assert all(isinstance(o, Prediction) for o in outcomes)
    assert (g.counters.oom_events, g.counters.oom_recoveries) == (1, 1)


def test_no_engine_without_an_oom_is_a_plain_failure_and_teaches_nothing(monkeypatch) -> None:
    """An architecture or number format cuDNN has no engine for: not "not enough memory",
    no split to one image, no enormous cost per image learned."""
    install_gpu(monkeypatch, total=8 * GiB)
    probe = CudaProbe(torch.device("cuda", 0), weights=0)
    g = guard()
    forward = ScriptedForward(fits=0, error=lambda: RuntimeError(NO_ENGINE))
    with pytest.raises(oom.NoEngine, match="no way to run this model") as raised:
        OomRecovery(forward, g, probe)([1, 2, 3, 4])
    assert "memory was not the cause" in str(raised.value) and NO_ENGINE in str(raised.value)
    assert forward.sizes == [4] and g.counters.oom_events == 0
    with pytest.raises(oom.NoEngine):  # warmup's and calibration's path says the same
        oom.unless_out_of_memory(lambda: forward([1]), probe.allocator_ooms)


@pytest.mark.parametrize("kind", OOM_ERRORS)
def test_recovery_splits_every_kind_of_oom_through_the_batcher(kind: str) -> None:
    """The real batcher runs the real recovery: every request is answered, nothing fails."""
    g = guard()
    forward = ScriptedForward(fits=2, error=OOM_ERRORS[kind])
    batcher: MicroBatcher[int, object] = MicroBatcher(
        OomRecovery(forward, g, CpuProbe(weights=0)), max_batch=8)
    futures = [batcher.submit(i, timeout_s=30) for i in range(8)]  # queued before it starts
    batcher.start()
    try:
        done, _ = wait(futures, timeout=30)
        assert len(done) == 8
        assert all(isinstance(f.result(), Prediction) for f in futures)
    finally:
        batcher.stop()
    assert forward.sizes == [8, 4, 2, 2, 4, 2, 2]
    assert (g.counters.oom_events, g.counters.oom_recoveries, g.counters.oom_failures) == (3, 3, 0)
    assert g.max_batch_now(0) <= 4  # it learned: at most half the failed batch fits


def _failing_batch(keep: list[weakref.ref[torch.Tensor]]) -> Callable[[list[int]], list[int]]:
    def run(items: list[int]) -> list[int]:
        activations = torch.ones(1000, 1000)  # what a forward pass holds when it fails
        keep.append(weakref.ref(activations))
        raise RuntimeError("model exploded")

    return run


def test_requests_get_the_error_without_the_batchs_traceback(monkeypatch) -> None:
    """The traceback's frames hold the batch's tensors (on a GPU, its activations): the
    error each request keeps must not keep them alive."""
    # Logging's records hold the traceback while pytest captures them: not under test here.
    monkeypatch.setattr(logging.getLogger("vramguard.engine"), "disabled", True)
    refs: list[weakref.ref[torch.Tensor]] = []
    batcher: MicroBatcher[int, int] = MicroBatcher(_failing_batch(refs), max_batch=4)
    futures: list[Future[int]] = [batcher.submit(i, timeout_s=30) for i in range(3)]
    gc.disable()  # freed by reference counting alone, as the device thread does
    try:
        batcher.start()
        wait(futures, timeout=30)
        batcher.stop()
        errors = [f.exception() for f in futures]
        assert all(isinstance(e, RuntimeError) and str(e) == "model exploded" for e in errors)
        assert all(e is not None and e.__traceback__ is None for e in errors)
        assert refs and refs[0]() is None, "a failed request keeps the batch's tensors alive"
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", STICKY_ERRORS)
def test_a_sticky_cuda_error_marks_the_engine_failed(kind: str) -> None:
    settings = load_settings(device="cpu", max_batch_size=2, cache=False)
    engine = InferenceEngine(settings)
    runtime = engine.warm_up(tiny_model())
    engine.phase = Phase.READY
    calls: list[int] = []

    def broken(samples: list[object]) -> list[Prediction]:
        calls.append(len(samples))
        raise STICKY_ERRORS[kind]()

    runtime.recovery.forward = broken
    engine.batcher.start()
    try:
        sample = runtime.predictor.random_batch(1)[0]
        first = engine.batcher.submit(sample, timeout_s=30)
        wait([first], timeout=30)
        error = first.exception()
        assert isinstance(error, NotReady) and error.status == 503
        assert engine.phase is Phase.FAILED and engine.error
        message = engine.not_ready_message()
        assert "graphics card" in message and "restart" in message.lower()
        with pytest.raises(NotReady):
            engine.require_runtime()
        # Whatever was already queued is refused without touching the broken device.
        later = engine.batcher.submit(sample, timeout_s=30)
        wait([later], timeout=30)
        assert isinstance(later.exception(), NotReady) and calls == [1]
    finally:
        engine.stop()
