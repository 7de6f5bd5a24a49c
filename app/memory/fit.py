"""Fit ``peak(batch) = c + k * batch`` to peaks measured at warmup."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryFit:
    """``fixed_bytes`` (c) every batch needs, plus ``bytes_per_sample`` (k) per image."""

    fixed_bytes: int
    bytes_per_sample: int

    def peak(self, batch_size: int) -> int:
        return self.fixed_bytes + self.bytes_per_sample * batch_size


def fit_linear(points: list[tuple[int, int]]) -> MemoryFit:
    """Least squares over (batch size, peak bytes above baseline), then raised until it is
    an upper bound at every measured point; c >= 0, k >= 1.

    With one size only, or a non-increasing fit (noise), everything is put on
    k, which over-estimates: the safe side for a memory guard.
    """
    if not points:
        raise ValueError("need at least one measurement")
    sizes = {size for size, _ in points}
    worst_per_sample = max(peak / size for size, peak in points)
    if len(sizes) < 2:
        return upper_bound(MemoryFit(0, max(1, round(worst_per_sample))), points)
    n = len(points)
    mean_x = sum(s for s, _ in points) / n
    mean_y = sum(p for _, p in points) / n
    sxx = sum((s - mean_x) ** 2 for s, _ in points)
    sxy = sum((s - mean_x) * (p - mean_y) for s, p in points)
    k = sxy / sxx
    c = mean_y - k * mean_x
    if k <= 0:
        fit = MemoryFit(0, max(1, round(worst_per_sample)))
    elif c < 0:
        fit = MemoryFit(0, max(1, round(max(k, worst_per_sample))))
    else:
        fit = MemoryFit(round(c), max(1, round(k)))
    return upper_bound(fit, points)


def upper_bound(fit: MemoryFit, points: list[tuple[int, int]]) -> MemoryFit:
    """``fit``, raised where a measured peak lies above it.

    Least squares leaves about half the points above its line, and a guard that plans
    for less than a batch was seen to need admits batches that run out of memory. The
    shortfall goes on ``c`` (every size alike) or on ``k`` (growing with the size),
    whichever over-estimates less summed over the sizes measured: a jump at a large size
    (cuDNN switching to an algorithm with a larger workspace) goes on ``k`` rather than
    making every small batch look as expensive. Serving never runs a batch larger than
    the largest measured (the chosen size is always measured), so ``k`` is not
    extrapolated past the points it was raised for.
    """
    shortfalls = [(size, peak - fit.peak(size)) for size, peak in points]
    if all(short <= 0 for _, short in shortfalls):
        return fit
    raise_c = max(short for _, short in shortfalls)
    raise_k = max(math.ceil(short / size) for size, short in shortfalls)
    if raise_c * len(points) <= raise_k * sum(size for size, _ in points):
        return MemoryFit(fit.fixed_bytes + raise_c, fit.bytes_per_sample)
    return MemoryFit(fit.fixed_bytes, fit.bytes_per_sample + raise_k)
