"""Batch size that adapts in service, from the times of the batches actually served.

Warmup's choice is a few seconds of measurement on a machine whose speed drifts (other
programs, clocks, heat). The device thread hands every batch it runs to
``AdaptiveBatchSize.observe``, which keeps a model of batch time and answers the size to use
next. Nothing here reads a clock, takes a lock or keeps a list: the caller measures, and the
state is a handful of numbers (one owner thread, O(1) per batch).

The rules:

- Model: a batch of n images takes ``a + b * n`` seconds (``LinearTime``), with a >= 0 and
  b > 0. ``BatchTimeFit`` fits it by weighted least squares over every observation, each
  weighted ``0.5 ** (age / half_life)``, age counted in observations (the newest has weight
  1). Warmup's (batch size, median seconds) points are the first observations, all of age 0
  at the start. Five running weighted sums hold the whole history.
- Slope only from spread: the slope is refitted only while the last ``half_life``
  observations hold two batch sizes or more. Otherwise the slope is held at the last one
  the data gave (warmup's until service has seen two sizes) and only the intercept is
  fitted: ``a`` is the weighted mean of ``seconds - b * n``, so a drift seen at the one size
  in use moves the fixed cost per batch. Held at warmup's slope instead, a slope learned in
  service would be forgotten a half-life after the last batch of another size, and the size
  would leave a good choice, learn again that it was good, and come back, every ~80 batches.
- Fallbacks, so that a >= 0 and b > 0 always. With spread, a negative intercept gives the
  least-squares line through the origin (the least-squares line among those with a >= 0),
  and its slope is the one learned; a slope at or below 0 (noise over a narrow range of
  sizes) is not used. With a held slope, an intercept less than 5 % of ``b * n`` below 0 is
  noise and is raised to 0; further below, the batches run faster than the held slope
  allows, which refutes it: warmup's slope is held from then on, or, refuted too, that of
  the line through the origin. Giving up a slope only on a clear refutation, and for good,
  keeps the line from flipping between two slopes on the noise.
- Best size: the largest n <= max_size with ``a + b * n <= target``, else 1. This is
  warmup's ``choose_batch_size`` rule (largest size within the target whose throughput is
  within ``NEAR_TIE`` of the best) applied to the line: with a >= 0, predicted throughput
  ``n / (a + b * n)`` never falls as n grows, so the largest size within the target is the
  best one and the near-tie margin cannot change the answer. The tests check the two agree.
- Hysteresis: the size moves to the best size only when that is predicted to give more than
  ``hysteresis`` (5 %) more images/s than the current size, or when the current size is
  predicted to break the latency target; and only once the same new size has been proposed
  for ``patience`` observations in a row. Any other observation starts the count again.
  The same margin makes a band around the latency target: the size in use is left when
  predicted over the target, but a size is proposed only when predicted within
  ``target * (1 - hysteresis)``, so a size near the target does not flip in and out of it
  with the noise.
- Memory: ``observe`` returns ``min(size, memory_limit)``. The memory guard's limit applies
  to the next batch at once, without hysteresis, but it is transient, so it does not move
  ``size``, the steady choice, which is back as soon as the limit allows. Under the linear
  model the capped size is also the best size within the limit.
- Every batch counts at its own size: a partial batch in a quiet moment, or one the memory
  guard capped, is an observation at the n it actually had.
- A time that is zero, negative or not finite (a coarse clock, a glitch) carries nothing and
  is ignored; a batch size below 1 is a caller's error (ValueError).

Limitations:

- Under steady load every batch is full at the current size, so the data hold one size and
  the slope cannot be relearned: a change in the cost per image is read as a change in the
  fixed cost per batch. The estimate at other sizes is then only as good as the held slope,
  and it is corrected only when batches of other sizes occur (quiet moments, memory caps,
  or a move of the size itself). Nothing explores sizes on purpose, so a move made on a
  wrong slope (e.g. down to 1 when the cost per image rose) is what teaches the slope.
- Data at sizes not served for a while still weigh in, and pivot the slope: after a drift,
  a size just past the target can be tried and left again a few times before the old data
  have faded (seen in simulation with a size 2 % over the target).
- A line with a >= 0 cannot represent a per-image cost that rises with batch size (cache
  effects on a CPU, where warmup measured batch 8 slower per image than 4): to it a larger
  batch is never worse. Simulated with warmup's example shape (1: 30 ms, 2: 50, 4: 85,
  8: 240), a 250 ms target and 5 % of batches partial (sizes 1-3), the line fitted mostly
  to sizes 1-4 predicted 8 at about 0.16 s and more than 5 % faster, so the size moved from
  4 to 8: 33 images/s instead of 47. Once 8 is measured the line goes through the origin
  (equal throughput everywhere), which gives no reason to go back. Without partial batches
  it stayed at 4.
- The fit follows a change at the pace of ``half_life``: after a step change, half the weight
  is on the new behaviour after ``half_life`` batches (sooner at the start, when the history
  is only warmup's few points), and a move waits ``patience`` more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Below this share of the weighted sum of squared sizes, the sizes' spread is rounding error.
_NO_SPREAD = 1e-9
# A held slope is refuted when batches run faster than it alone allows (b * n, with a = 0)
# by more than this share; within it, the shortfall is taken for noise.
_REFUTED = 0.05


@dataclass(frozen=True)
class LinearTime:
    """Seconds of a batch of n images: a fixed cost ``a`` per batch plus ``b`` per image."""

    a: float
    b: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a) and math.isfinite(self.b) and self.a >= 0 and self.b > 0):
            raise ValueError(f"a batch time line needs a >= 0 and b > 0, not a={self.a}, "
                             f"b={self.b}")

    def seconds(self, n: int) -> float:
        return self.a + self.b * n

    def per_image(self, n: int) -> float:
        return self.seconds(n) / n

    def images_per_second(self, n: int) -> float:
        return n / self.seconds(n)


def best_size(line: LinearTime, max_size: int, target_latency_s: float) -> int:
    """The largest size up to ``max_size`` predicted within the target; 1 if none is.

    Solved directly rather than by trying every size: this runs after every batch, and
    ``max_size`` may be in the hundreds. The floor is nudged one step either way so that
    rounding never disagrees with comparing ``line.seconds(n)`` to the target.
    """
    if line.seconds(1) > target_latency_s:
        return 1
    n = min(max_size, max(1, math.floor((target_latency_s - line.a) / line.b)))
    if n < max_size and line.seconds(n + 1) <= target_latency_s:
        n += 1
    if n > 1 and line.seconds(n) > target_latency_s:
        n -= 1
    return n


def _check_size(n: int) -> None:
    if n < 1:
        raise ValueError(f"a batch has at least one image, not {n}")


def _carries_information(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds > 0


class BatchTimeFit:
    """Exponentially weighted least squares of batch seconds against batch size.

    ``prior`` is warmup's (batch size, median seconds) points: they are the first
    observations, and their own least-squares line, ``prior``, gives the slope held until
    service has seen two batch sizes (see the module's rules).
    """

    def __init__(self, prior: Sequence[tuple[int, float]], *, half_life: float = 64.0) -> None:
        if not (math.isfinite(half_life) and half_life > 0):
            raise ValueError(f"half_life must be a positive number of batches, not {half_life}")
        if not prior:
            raise ValueError("the fit needs warmup's timings to start from")
        self._decay = 0.5 ** (1 / half_life)
        self._window = math.ceil(half_life)
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        for n, seconds in prior:
            _check_size(n)
            if not _carries_information(seconds):
                raise ValueError(f"warmup's time for a batch of {n} must be positive, "
                                 f"not {seconds}")
            self._add(n, seconds)
        slope = self._slope() if len({n for n, _ in prior}) > 1 else None
        self.prior: LinearTime = self._solve(slope) or self._through_origin()
        self._line = self.prior
        self._held_slope = self.prior.b  # the last slope the data gave
        self.observations = 0  # accepted by ``observe``; the prior's points are not counted
        self._newest_size: int | None = None
        self._other_size_at: int | None = None  # last observation of a size other than newest

    @property
    def line(self) -> LinearTime:
        return self._line

    @property
    def slope_from_data(self) -> bool:
        """True while the last ``half_life`` observations hold two batch sizes or more: only
        then does the data say anything about the slope."""
        return (self._other_size_at is not None
                and self.observations - self._other_size_at < self._window)

    def observe(self, n: int, seconds: float) -> bool:
        """Add one batch of ``n`` images that took ``seconds``; False, and nothing changes,
        for a time that carries no information (zero, negative, not finite)."""
        _check_size(n)
        if not _carries_information(seconds):
            return False
        self.observations += 1
        if n != self._newest_size:
            if self._newest_size is not None:
                self._other_size_at = self.observations - 1
            self._newest_size = n
        self._w *= self._decay
        self._sx *= self._decay
        self._sy *= self._decay
        self._sxx *= self._decay
        self._sxy *= self._decay
        self._add(n, seconds)
        slope = self._slope() if self.slope_from_data else None
        if slope is not None:
            self._line = self._solve(slope) or self._through_origin()
            self._held_slope = self._line.b
        else:
            self._line = self._with_held_slope(n)
        return True

    def _with_held_slope(self, n: int) -> LinearTime:
        """The line for batches all of size ``n`` lately: the held slope and its intercept.

        An intercept a little below 0 is noise, and is raised to 0. Batches faster than the
        slope allows by more than ``_REFUTED`` refute it: warmup's slope is held instead,
        and, if that is refuted too, the line through the origin's. The refuted slope is
        not tried again, so the line does not flip between two slopes on the noise.
        """
        for slope in (self._held_slope, self.prior.b):
            a = (self._sy - slope * self._sx) / self._w
            if a >= -_REFUTED * slope * n:
                self._held_slope = slope
                return LinearTime(max(a, 0.0), slope)
        line = self._through_origin()
        self._held_slope = line.b
        return line

    def _add(self, n: int, seconds: float) -> None:
        self._w += 1.0
        self._sx += n
        self._sy += seconds
        self._sxx += n * n
        self._sxy += n * seconds

    def _slope(self) -> float | None:
        """The weighted least-squares slope; None when the sizes do not spread or the slope
        is not positive."""
        spread = self._sxx - self._sx * self._sx / self._w
        if spread <= _NO_SPREAD * self._sxx:
            return None
        slope = (self._sxy - self._sx * self._sy / self._w) / spread
        return slope if slope > 0 else None

    def _solve(self, slope: float | None) -> LinearTime | None:
        """The line with ``slope`` and its weighted least-squares intercept; None without a
        slope or when the intercept would be negative."""
        if slope is None:
            return None
        a = (self._sy - slope * self._sx) / self._w
        return LinearTime(a, slope) if a >= 0 else None

    def _through_origin(self) -> LinearTime:
        """The least-squares line with a = 0: the best fit when the intercept cannot be."""
        return LinearTime(0.0, self._sxy / self._sxx)


class AdaptiveBatchSize:
    """The batch size to run next, from warmup's timings and every batch since.

    Called on the device thread after each batch; see the module's rules.
    """

    def __init__(self, prior: Sequence[tuple[int, float]], *, initial: int, max_size: int,
                 target_latency_s: float, hysteresis: float = 0.05, patience: int = 8,
                 half_life: float = 64.0) -> None:
        if not 1 <= initial <= max_size:
            raise ValueError(f"the initial size {initial} must be within 1..{max_size}")
        if not (math.isfinite(target_latency_s) and target_latency_s > 0):
            raise ValueError(f"target_latency_s must be positive, not {target_latency_s}")
        if not 0 <= hysteresis < 1 or patience < 1:
            raise ValueError("hysteresis must be within [0, 1) and patience >= 1")
        self.fit = BatchTimeFit(prior, half_life=half_life)
        self.size = initial  # the steady choice; the memory guard may cap a batch below it
        self.changes = 0
        self.max_size = max_size
        self.target_latency_s = target_latency_s
        self.hysteresis = hysteresis
        self.patience = patience
        self._proposal: int | None = None
        self._proposed = 0  # consecutive observations that proposed ``_proposal``

    def observe(self, n: int, seconds: float, *, memory_limit: int) -> int:
        """Record one batch (``n`` images took ``seconds``) and return the size for the next:
        the steady size, capped at once by the memory guard's current ``memory_limit``."""
        if memory_limit < 1:
            raise ValueError(f"memory_limit must be >= 1, not {memory_limit}")
        if self.fit.observe(n, seconds):
            self._reconsider()
        return min(self.size, memory_limit)

    def _reconsider(self) -> None:
        line = self.fit.line
        best = best_size(line, self.max_size, self.target_latency_s * (1 - self.hysteresis))
        if best == self.size or not self._worth_moving(line, best):
            self._proposal, self._proposed = None, 0
            return
        if best != self._proposal:
            self._proposal, self._proposed = best, 0
        self._proposed += 1
        if self._proposed >= self.patience:
            self.size = best
            self.changes += 1
            self._proposal, self._proposed = None, 0

    def _worth_moving(self, line: LinearTime, best: int) -> bool:
        gain = line.images_per_second(best) / line.images_per_second(self.size) - 1
        return gain > self.hysteresis or line.seconds(self.size) > self.target_latency_s
