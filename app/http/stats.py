"""Counters of answered requests by outcome, for /v1/stats, and the serving of the last
minute (images per second, answer times, refusals by reason) for the live samples.

The serving window keeps one tally per second and model for the last ``WINDOW_S``
seconds: a count of answers, their answer times in a histogram with bins 2^(1/8) wide
(so a median read from it is within 5 % of the true one), and refusals by reason. Its
memory is bounded (the seconds, times at most ``MAX_MODELS`` names, times the bins in
use), a request costs a dictionary update, and the percentiles are worked out once per
sample.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from starlette.types import Scope

from app.http.scope import IMAGE_ROUTES, OIP_INFER
from app.schemas import ServingFigures, ServingReport

WINDOW_S = 60  # answer times and refusal counts: the last minute
RATE_S = 10  # images and refusals per second: the last ten seconds
MAX_MODELS = 16  # names kept apart; any more are counted in the total only
BINS_PER_OCTAVE = 8
REASONS = ("rate_limited", "overloaded", "bad_input", "insufficient_memory", "other")
_REASON_OF = {
    "rate_limited": "rate_limited",
    "overloaded": "overloaded", "deadline_exceeded": "overloaded",
    "bad_image": "bad_input", "bad_request": "bad_input", "not_found": "bad_input",
    "unsupported_media_type": "bad_input", "payload_too_large": "bad_input",
    "image_too_large": "bad_input", "image_too_complex": "bad_input",
    "insufficient_memory": "insufficient_memory",
}
DEFAULT = ""  # the model of a request that names none (--model)


def reason_of(code: str) -> str:
    """The refusal reason the dashboard shows for an error code."""
    return _REASON_OF.get(code, "other")


def image_model(scope: Scope) -> str | None:
    """The model an image request names (``DEFAULT`` when it names none), None when the
    request sends no image to a model."""
    path = scope["path"]
    if (match := OIP_INFER.match(path)) is not None:
        return match.group(0).split("/")[3]
    if path not in IMAGE_ROUTES:
        return None
    query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
    return query.get("model", [DEFAULT])[0][:64]


@dataclass
class Tally:
    answers: int = 0
    bins: Counter[int] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)

    def add(self, other: Tally) -> None:
        self.answers += other.answers
        self.bins.update(other.bins)
        self.refused.update(other.refused)


def bin_of(seconds: float) -> int:
    return math.floor(math.log2(max(seconds * 1000, 0.001)) * BINS_PER_OCTAVE)


def percentile(bins: Counter[int], share: float) -> float | None:
    """The answer time in ms below which ``share`` of the answers fall (nearest rank),
    read as the middle of its bin; None without answers."""
    count = sum(bins.values())
    if not count:
        return None
    rank, seen = max(1, math.ceil(share * count)), 0
    for index in sorted(bins):
        seen += bins[index]
        if seen >= rank:
            return round(2 ** ((index + 0.5) / BINS_PER_OCTAVE), 2)
    raise AssertionError("the ranks add up to the count")


class ServingWindow:
    """Per-second tallies by model over the last ``WINDOW_S`` seconds; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self._seconds: deque[tuple[int, dict[str | None, Tally]]] = deque()
        self._seen: dict[str, int] = {}  # name: the last second it was tallied
        self._lock = threading.Lock()

    def _tally(self, model: str | None) -> Tally:
        """This second's tally for ``model`` (None: counted in the total only, as is a
        name beyond the ``MAX_MODELS`` seen in the window)."""
        now = math.floor(self.clock())
        if not self._seconds or self._seconds[-1][0] != now:
            self._seconds.append((now, {}))
            while self._seconds[0][0] <= now - WINDOW_S:
                self._seconds.popleft()
            for name in [n for n, last in self._seen.items() if last <= now - WINDOW_S]:
                del self._seen[name]
        if model is not None:
            if model in self._seen or len(self._seen) < MAX_MODELS:
                self._seen[model] = now
            else:
                model = None
        return self._seconds[-1][1].setdefault(model, Tally())

    def answered(self, model: str, seconds: float) -> None:
        with self._lock:
            tally = self._tally(model)
            tally.answers += 1
            tally.bins[bin_of(seconds)] += 1

    def refused(self, model: str, code: str) -> None:
        with self._lock:
            self._tally(model).refused[reason_of(code)] += 1

    def report(self, default_model: str) -> ServingReport:
        """The figures of the last minute, in total and per model (``DEFAULT`` read as
        ``default_model``)."""
        now = self.clock()
        span = min(float(RATE_S), max(1.0, now - self.started))
        whole: dict[str | None, Tally] = {}
        recent: dict[str | None, Tally] = {}
        with self._lock:
            for second, tallies in self._seconds:
                if second <= now - WINDOW_S:
                    continue
                for name, tally in tallies.items():
                    key = default_model if name == DEFAULT else name
                    for table, wanted in ((whole, True), (recent, second > now - RATE_S)):
                        if wanted:
                            table.setdefault(key, Tally()).add(tally)
        total, total_recent = Tally(), Tally()
        for table, into in ((whole, total), (recent, total_recent)):
            for tally in table.values():
                into.add(tally)

        def figures(tally: Tally, last: Tally) -> ServingFigures:
            return ServingFigures(
                images_per_s=round(last.answers / span, 2), answers=tally.answers,
                p50_ms=percentile(tally.bins, 0.5), p95_ms=percentile(tally.bins, 0.95),
                refused={reason: tally.refused[reason] for reason in REASONS},
                refused_per_s={reason: round(last.refused[reason] / span, 2)
                               for reason in REASONS})

        return ServingReport(
            window_s=WINDOW_S, rate_s=RATE_S, total=figures(total, total_recent),
            models={name: figures(tally, recent.get(name, Tally()))
                    for name, tally in sorted(whole.items(), key=lambda kv: str(kv[0]))
                    if name is not None})


class RequestStats:
    """Thread-safe outcome counter; ``ok`` and ``cached`` for successes, else the error
    code. The answers and refusals of image requests also go to ``serving``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.started = time.monotonic()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.serving = ServingWindow(clock)

    def count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def answered(self, model: str, outcome: str, seconds: float) -> None:
        """One image of ``model`` answered (``ok`` or ``cached``) ``seconds`` after its
        request (or, in a stream, its part) arrived."""
        self.count(outcome)
        self.serving.answered(model, seconds)

    def failed(self, code: str, scope: Scope) -> None:
        """A request (or one image of a stream) answered with the error ``code``."""
        self.count(code)
        model = image_model(scope)
        if model is not None:
            self.serving.refused(model, code)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started
