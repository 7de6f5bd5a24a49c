"""The offline limit: decode + preprocess + inference in a tight in-process loop.

No HTTP, no queue: what the model and the image pipeline can do on this
machine at the best batch size. A server cannot beat it by much; the ratio
to it says how much the serving layer costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models import LoadedModel


@dataclass(frozen=True)
class OfflineResult:
    batch_size: int
    images_per_second: float


def offline_throughput(model: LoadedModel, image: bytes, batch_size: int,
                       seconds: float) -> OfflineResult:
    """Images per second for ``seconds`` of decode+preprocess+forward at ``batch_size``."""
    spec = model.preprocessing

    def one_batch() -> None:
        pixels = [torch.from_numpy(model_input(open_image(image, 40_000_000, spec.resize), spec))
                  for _ in range(batch_size)]
        with torch.inference_mode():
            model.module(torch.stack(pixels)).softmax(-1).topk(min(5, model.num_classes))

    one_batch()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        one_batch()
        done += batch_size
    return OfflineResult(batch_size, done / (time.perf_counter() - started))


def offline_limit(model: LoadedModel, image: bytes, sizes: tuple[int, ...] = (1, 2, 4, 8),
                  seconds: float = 5.0) -> tuple[OfflineResult, list[OfflineResult]]:
    """The best throughput over ``sizes``, and every measurement."""
    results = [offline_throughput(model, image, size, seconds) for size in sizes]
    return max(results, key=lambda r: r.images_per_second), results
