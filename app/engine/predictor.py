"""The forward pass: stack, run the model, softmax (a multilabel model: a sigmoid per
label) and top-k on the device; an embedding model's output is its features.

Only the small ranked result is copied back to the host. On CUDA the batch is stacked
into a reused pinned (page-locked) host buffer and copied to the GPU asynchronously:
from pageable memory the driver first copies into a pinned bounce buffer of its own,
and the copy blocks the device thread. On the CPU nothing is copied and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.models import LoadedModel, tap_features
from app.models.precision import FP32, Numerics

CUDNN_BENCHMARK = False  # why: see Predictor.__init__


CLASSIFY, EMBED = "classify", "embed"  # what a request wants from the forward pass
MULTILABEL = "multilabel"  # a model's task besides those two: a sigmoid per label


@dataclass(frozen=True)
class Sample:
    """One preprocessed image, how many classes its client wants back, and whether it
    wants its ranking (``CLASSIFY``) or its features (``EMBED``)."""

    pixels: torch.Tensor
    top_k: int
    task: str = CLASSIFY


@dataclass(frozen=True)
class Ranked:
    """Class indices and probabilities, best first."""

    indices: np.ndarray
    scores: np.ndarray

    def top(self, k: int) -> Ranked:
        return Ranked(self.indices[:k], self.scores[:k])


@dataclass(frozen=True)
class Prediction:
    """A ranking (or, for ``EMBED``, the L2-normalised features) plus the size of the batch
    it was computed in."""

    ranked: Ranked
    batch_size: int
    embedding: np.ndarray | None = None


def numerics(device: torch.device, model: Numerics = FP32) -> str:
    """What, besides the model and the image, decides a result's last digits: the device
    type, the model's precision and layout (``app.models.precision``) and, on CUDA,
    whether TF32 may stand in for float32 in convolutions and matrix products. A GPU's
    scores differ from the CPU's by about 1e-3, bf16's from fp32's by about 5e-3; the
    result cache keys by this so that an answer computed one way is never served as the
    other."""
    if device.type != "cuda":
        return device.type if model == FP32 else f"{device.type} {model.label}"
    backends: Any = torch.backends  # fp32_precision (torch >= 2.9) is not in torch's stubs
    root = backends.fp32_precision
    conv = _first_set(backends.cudnn.conv.fp32_precision, backends.cudnn.fp32_precision, root)
    matmul = _first_set(backends.cuda.matmul.fp32_precision, root)
    return f"cuda {model.label} conv={conv} matmul={matmul}"


def _first_set(*precisions: str) -> str:
    """torch's fp32 precision of an operator family: its own, else its parent's ("none"
    means inherit); unset throughout means full float32."""
    return next((p for p in precisions if p != "none"), "ieee")


class StagingBuffer:
    """The host buffer each batch is stacked into, reused from batch to batch so that
    page-locking memory (slow) is paid once, not per batch; it grows when a batch is
    larger than any before."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def stack(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """``torch.stack(pixels)``, written into the buffer."""
        self._wait()
        first, count = pixels[0], len(pixels)
        buffer = self.buffer
        if (buffer is None or buffer.shape[0] < count or buffer.shape[1:] != first.shape
                or buffer.dtype != first.dtype):
            self.buffer = None  # give the old one back before taking a larger one
            buffer = self.buffer = torch.empty((count, *first.shape), dtype=first.dtype,
                                               pin_memory=self.pin)
        return torch.stack(pixels, out=buffer[:count])

    def upload(self, pixels: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Stack into the pinned buffer and start the copy to ``device`` without waiting
        for it (work queued after it on the stream runs after it)."""
        on_device = self.stack(pixels).to(device, non_blocking=True)
        self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: no hints
        self._copied.record(torch.cuda.current_stream(device))
        return on_device

    def release(self) -> None:
        """Give the buffer back (the idle release, Empty GPU cache): page-locked memory
        held at twice the largest batch for ever is the computer's, not only vramguard's.
        The next batch takes a new one, paying the page-locking once more."""
        self._wait()
        self.buffer = None

    def _wait(self) -> None:
        """Wait until the last copy out of the buffer is done before overwriting it. A
        batch that completes has already waited (its results were copied back); one that
        failed, such as an OOM about to be split and retried, may not have."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None


class Predictor:
    """Callable the batcher runs on the device thread.

    With ``keep_all`` (the result cache is on) every class is ranked so that a
    cached answer can serve any later ``top_k``; otherwise only the largest
    ``top_k`` of the batch leaves the device.
    """

    def __init__(self, model: LoadedModel, keep_all: bool) -> None:
        self.model = model
        self.keep_all = keep_all
        # cuDNN's autotuner off, explicitly (torch's default, but any import could flip
        # it): with it on, the first batch of every new size tries each convolution
        # algorithm, allocating each one's workspace, and keeps the fastest whatever its
        # workspace. Serving sees every size from 1 to the batch size, so memory would
        # jump mid-serving at sizes warmup never measured, differently from run to run.
        # The heuristic choice is fixed per shape, so warmup's measurements hold.
        torch.backends.cudnn.benchmark = CUDNN_BENCHMARK
        self.staging = StagingBuffer(pin=True) if model.device.type == "cuda" else None

    def __call__(self, samples: list[Sample]) -> list[Prediction]:
        """The whole batch call serving pays: stack, copy to the device, forward pass,
        softmax and top-k, copy back (which waits for the device: the call is
        synchronised)."""
        model = self.model
        classes = model.num_classes
        # every label of a multilabel model: the route keeps those above the threshold
        everything = self.keep_all or model.task == MULTILABEL
        k = classes if everything else min(classes, max(s.top_k for s in samples))
        pixels = [s.pixels for s in samples]
        if self.staging is None:
            batch = torch.stack(pixels).to(model.device)
        else:
            batch = self.staging.upload(pixels, model.device)
        batch = model.numerics.batch(batch)  # on the device: the copy stays fp32 pixels
        size = len(samples)
        embedded: list[np.ndarray | None] = [None] * size
        with torch.inference_mode():
            if model.task == EMBED:  # the model's output is its features
                out = torch.nn.functional.normalize(model.module(batch).float(), dim=-1)
                vectors = out.cpu().numpy()
                empty = Ranked(np.zeros(0, np.int64), np.zeros(0, np.float32))
                return [Prediction(empty, size, vectors[i]) for i in range(size)]
            if any(s.task == EMBED for s in samples):
                with tap_features(model.module, classes) as tap:
                    logits = model.module(batch)
                features = torch.nn.functional.normalize(tap.features.float(), dim=-1)
                rows = features.cpu().numpy()
                embedded = [rows[i] if s.task == EMBED else None
                            for i, s in enumerate(samples)]
            else:
                logits = model.module(batch)
            logits = logits.float()
            probs = logits.sigmoid() if model.task == MULTILABEL else logits.softmax(dim=-1)
            scores, indices = probs.topk(k, dim=-1)
            scores, indices = scores.cpu().numpy(), indices.cpu().numpy()
        return [Prediction(Ranked(indices[i], scores[i]), size, embedded[i])
                for i in range(size)]

    def random_batch(self, size: int) -> list[Sample]:
        """Inputs of the real shape for warmup; their content does not matter."""
        spec = self.model.preprocessing
        return [Sample(torch.randn(spec.channels, spec.crop, spec.crop), 1)
                for _ in range(size)]
