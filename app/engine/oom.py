"""Recovery from out-of-memory in a forward pass: free, split in halves, retry.

The process never dies of it: a batch that does not fit is split until the
halves fit; a single image that still does not fit gets 503
``insufficient_memory``, and everything else carries on.

On CUDA, running out of memory does not always arrive as ``torch.OutOfMemoryError``
(the caching allocator's own error). A kernel launch or a lazily loaded module raises
``torch.AcceleratorError`` ("CUDA error: out of memory"); cuDNN and cuBLAS raise plain
``RuntimeError``s when their workspace cannot be allocated, and when PyTorch's cuDNN
convolution has swallowed its workspace OOMs while trying engines, it ends with "unable to
find an engine" (pytorch/pytorch#108645). All of these are the same event for the guard.

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
# uncorrectable ECC, illegal address, launch timeout, device assert, hardware stack error,
# illegal instruction, misaligned address, invalid address space, invalid PC, launch failure.
STICKY_CUDA_ERRORS = frozenset({214, 700, 702, 710, 714, 715, 716, 717, 718, 719})
# The same errors as the CUDA runtime words them, for exceptions that carry no code.
_STICKY_MESSAGES = re.compile(
    "illegal memory access|unspecified launch failure|device-side assert|"
    "illegal instruction|misaligned address|launch timed out|uncorrectable ECC|"
    "hardware stack error|invalid program counter|not supported on global/shared address",
    re.IGNORECASE)
# cuDNN, cuBLAS, cuSOLVER, cuSPARSE and cuFFT's own allocation failures, the CUDA runtime's
# (torch < 2.8 raised it as a plain RuntimeError), and cuDNN's "no engine" after it has
# swallowed its workspace OOMs.
_OOM_MESSAGES = re.compile(
    r"\bCU\w*_ALLOC_FAILED\b|CUDA error: out of memory|unable to find an engine")


class ErrorKind(enum.Enum):
    OUT_OF_MEMORY = "out_of_memory"
    DEVICE_LOST = "device_lost"
    OTHER = "other"


def classify_error(exc: BaseException) -> ErrorKind:
    """What a failed forward pass means: out of memory (split and retry), a lost CUDA
    context (stop serving), or anything else (fail the batch as before)."""
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
    if code in STICKY_CUDA_ERRORS or _STICKY_MESSAGES.search(text):
        return ErrorKind.DEVICE_LOST
    return ErrorKind.OTHER


def unless_out_of_memory(fn: Callable[[], T]) -> T | None:
    """``fn()``, or None when it ran out of memory (in any of the forms CUDA has); other
    errors are raised. On return the exception and the frames it held are gone."""
    try:
        return fn()
    except Exception as exc:
        if classify_error(exc) is not ErrorKind.OUT_OF_MEMORY:
            raise
    return None


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
        try:
            with self.probe.forward_scope():
                return list(self.forward(samples))
        except Exception as exc:
            kind = classify_error(exc)
            if kind is ErrorKind.OTHER:
                raise
            if kind is ErrorKind.DEVICE_LOST:
                log.exception("the GPU failed in a batch of %d", len(samples))
                lost = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
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
