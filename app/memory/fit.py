"""Fit ``peak(batch) = c + k * batch`` to peaks measured at warmup."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryFit:
    """``fixed_bytes`` (c) every batch needs, plus ``bytes_per_sample`` (k) per image."""

    fixed_bytes: int
    bytes_per_sample: int

    def peak(self, batch_size: int) -> int:
        return self.fixed_bytes + self.bytes_per_sample * batch_size


def fit_linear(points: list[tuple[int, int]]) -> MemoryFit:
    """Least squares over (batch size, peak bytes above baseline); c >= 0, k >= 1.

    With one size only, or a non-increasing fit (noise), everything is put on
    k, which over-estimates: the safe side for a memory guard.
    """
    if not points:
        raise ValueError("need at least one measurement")
    sizes = {size for size, _ in points}
    worst_per_sample = max(peak / size for size, peak in points)
    if len(sizes) < 2:
        return MemoryFit(0, max(1, round(worst_per_sample)))
    n = len(points)
    mean_x = sum(s for s, _ in points) / n
    mean_y = sum(p for _, p in points) / n
    sxx = sum((s - mean_x) ** 2 for s, _ in points)
    sxy = sum((s - mean_x) * (p - mean_y) for s, p in points)
    k = sxy / sxx
    c = mean_y - k * mean_x
    if k <= 0:
        return MemoryFit(0, max(1, round(worst_per_sample)))
    if c < 0:  # keep every measured point under the line
        return MemoryFit(0, max(1, round(max(k, worst_per_sample))))
    return MemoryFit(round(c), max(1, round(k)))
