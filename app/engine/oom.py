"""Recovery from out-of-memory in a forward pass: free, split in halves, retry.

The process never dies of it: a batch that does not fit is split until the
halves fit; a single image that still does not fit gets 503
``insufficient_memory``, and everything else carries on.

On CUDA, running out of memory does not always arrive as ``torch.OutOfMemoryError``
(the caching allocator's own error). A kernel launch or a lazily loaded module raises
``torch.AcceleratorError`` ("CUDA error: out of memory"); cuDNN and cuBLAS raise plain
``RuntimeError``s when their workspace or handle cannot be allocated (cuDNN 9 words it
``CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED``; ``cublasCreate`` fails with
``CUBLAS_STATUS_NOT_INITIALIZED``; a JIT-compiled kernel's own allocation surfaces as
``CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER`` with the driver's error 2). All of these are
the same event for the guard.

PyTorch's cuDNN convolution tries engine after engine and swallows every error on the way,
so "unable to find an engine" (pytorch/pytorch#108645) may end a run of workspace OOMs or
mean that this GPU, or this number format, has no engine at all. It is counted as out of
memory only when the caching allocator's ``num_ooms`` rose during the call; otherwise it
is ``NoEngine``, with a plain message, and nothing is learned about memory.

cuDNN's ``HOST_ALLOCATION_FAILED`` is the computer's memory, not the GPU's: splitting the
batch would teach the guard a GPU cost that does not exist and would not free host memory
that other programs took. The batch is answered 503 (try again later) and the guard is
left as it was.

A *sticky* CUDA error (an illegal memory access, a failed launch, a device-side assert)
is different: the CUDA context is broken for the rest of the process and every later call
fails. It cannot be repaired in-process (torch has no supported way to recreate the
context while tensors and library handles exist), so it is reported as ``DeviceFailed``
and the engine stops serving until the process is restarted.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable
from typing import TypeVar

import torch

from app.engine.predictor import Prediction, Sample
from app.errors import InsufficientMemory
from app.memory.guard import MemoryGuard
from app.memory.probes import Probe

log = logging.getLogger("vramguard.engine")
Outcome = Prediction | InsufficientMemory
T = TypeVar("T")

CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
# cudaError_t codes after which the context is unusable (CUDA runtime API, "sticky" errors):
# devices unavailable, no device, uncorrectable ECC, illegal address, launch timeout,
# context destroyed, device assert, hardware stack error, illegal instruction, misaligned
# address, invalid address space, invalid PC, launch failure, unknown (a GPU off the bus).
STICKY_CUDA_ERRORS = frozenset({46, 100, 214, 700, 702, 709, 710, 714, 715, 716, 717, 718,
                                719, 999})
# The same errors as the CUDA runtime words them, for exceptions that carry no code.
_STICKY_MESSAGES = re.compile(
    "illegal memory access|unspecified launch failure|device-side assert|"
    "illegal instruction|misaligned address|launch timed out|uncorrectable ECC|"
    "hardware stack error|invalid program counter|not supported on global/shared address|"
    "CUDA error: unknown error|busy or unavailable|no CUDA-capable device is detected|"
    "context is destroyed",
    re.IGNORECASE)
# The GPU's memory ran out, as the CUDA runtime and driver, cuDNN (8: ALLOC_FAILED, 9:
# DEVICE_ALLOCATION_FAILED), cuBLAS, cuSOLVER, cuSPARSE and cuFFT word it (torch < 2.8
# raised the runtime's as a plain RuntimeError).
_OOM_MESSAGES = re.compile(
    r"\bCU\w*_ALLOC_FAILED\b|_DEVICE_ALLOCATION_FAILED\b|CUDA error: out of memory|"
    r"\bCUDA_ERROR_OUT_OF_MEMORY\b|\bCUBLAS_STATUS_NOT_INITIALIZED\b|"
    r"\bCUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER\b.*\berr(?:or)?\W{0,3}2\b",
    re.DOTALL)
_HOST_OOM_MESSAGES = re.compile(r"_HOST_ALLOCATION_FAILED\b")
_NO_ENGINE = re.compile("unable to find an engine")


class ErrorKind(enum.Enum):
    OUT_OF_MEMORY = "out_of_memory"
    HOST_OUT_OF_MEMORY = "host_out_of_memory"
    NO_ENGINE = "no_engine"
    DEVICE_LOST = "device_lost"
    OTHER = "other"


def no_count() -> int:
    """The allocator's failure count where there is no caching allocator (the CPU)."""
    return 0


def classify_error(exc: BaseException, ooms_rose: bool = False) -> ErrorKind:
    """What a failed call on the device means: the GPU out of memory (split and retry),
    the computer out of memory, no cuDNN engine for this GPU, a lost CUDA context (stop
    serving), or anything else (fail the batch as before). ``ooms_rose``: the caching
    allocator counted a failure during the call (what makes "no engine" an OOM)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return ErrorKind.OUT_OF_MEMORY
    if not isinstance(exc, RuntimeError):
        return ErrorKind.OTHER
    text = str(exc)
    code = getattr(exc, "error_code", None)  # set by torch on AcceleratorError
    if code == CUDA_ERROR_MEMORY_ALLOCATION or _OOM_MESSAGES.search(text):
        return ErrorKind.OUT_OF_MEMORY
    if isinstance(exc, torch.AcceleratorError) and "out of memory" in text.lower():
        return ErrorKind.OUT_OF_MEMORY
    if _HOST_OOM_MESSAGES.search(text):
        return ErrorKind.HOST_OUT_OF_MEMORY
    if _NO_ENGINE.search(text):
        return ErrorKind.OUT_OF_MEMORY if ooms_rose else ErrorKind.NO_ENGINE
    if code in STICKY_CUDA_ERRORS or _STICKY_MESSAGES.search(text):
        return ErrorKind.DEVICE_LOST
    return ErrorKind.OTHER


def first_line(exc: BaseException) -> str:
    """An error's first line, or its type's name when it has no message."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


class NoEngine(RuntimeError):
    """cuDNN has no way to run this model on this GPU, and memory was not the reason."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(
            "The graphics card's cuDNN library found no way to run this model (the card or "
            "the model's number format is not supported by it); memory was not the cause. "
            f"Run it on the CPU instead (device = cpu). cuDNN said: {first_line(cause)}")


def unless_out_of_memory(fn: Callable[[], T], ooms: Callable[[], int] = no_count) -> T | None:
    """``fn()``, or None when it ran out of the GPU's memory (in any of the forms CUDA
    has); other errors are raised (``NoEngine`` for cuDNN's). ``ooms`` reads the caching
    allocator's failure count. On return the exception and the frames it held are gone."""
    before = ooms()
    try:
        return fn()
    except Exception as exc:
        kind = classify_error(exc, ooms() > before)
        if kind is ErrorKind.NO_ENGINE:
            raise NoEngine(exc) from exc
        if kind is not ErrorKind.OUT_OF_MEMORY:
            raise
    return None


HOST_MEMORY_MESSAGE = ("The computer (not the graphics card) ran out of memory for this "
                       "request. Close other programs, or try again later.")


class DeviceFailed(RuntimeError):
    """The GPU's CUDA context is broken (a sticky error): nothing more can run on it in
    this process. The message is the CUDA error's first line."""


class OomRecovery:
    """Runs ``forward`` on the device thread and turns OOMs into splits and retries."""

    def __init__(self, forward: Callable[[list[Sample]], list[Prediction]], guard: MemoryGuard,
                 probe: Probe) -> None:
        self.forward = forward
        self.guard = guard
        self.probe = probe

    def __call__(self, samples: list[Sample]) -> list[Outcome]:
        lost: str | None = None
        ooms = self.probe.allocator_ooms()
        try:
            with self.probe.forward_scope():
                return list(self.forward(samples))
        except Exception as exc:
            kind = classify_error(exc, self.probe.allocator_ooms() > ooms)
            if kind is ErrorKind.NO_ENGINE:
                raise NoEngine(exc) from exc
            if kind is ErrorKind.OTHER:
                raise
            if kind is ErrorKind.HOST_OUT_OF_MEMORY:
                log.warning("the computer ran out of memory in a batch of %d: %s",
                            len(samples), first_line(exc))
                return [InsufficientMemory(HOST_MEMORY_MESSAGE, retry_after=5)
                        for _ in samples]
            if kind is ErrorKind.DEVICE_LOST:
                log.exception("the GPU failed in a batch of %d", len(samples))
                lost = first_line(exc)
        # Outside the except block the exception, its traceback and the frames that held
        # the batch's activations are gone, so the memory can really be given back.
        if lost is not None:
            raise DeviceFailed(lost)
        self.guard.on_oom(len(samples), self.probe.in_use())
        self.probe.empty_cache()
        if len(samples) == 1:
            self.guard.counters.oom_failures += 1
            return [InsufficientMemory(
                "Not enough GPU memory for this image right now, even on its own. Close "
                "other programs that use the graphics card, or try again later.",
                retry_after=5)]
        middle = len(samples) // 2
        outcomes = self(samples[:middle]) + self(samples[middle:])
        if not any(isinstance(o, InsufficientMemory) for o in outcomes):
            self.guard.counters.oom_recoveries += 1
        return outcomes
