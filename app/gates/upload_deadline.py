"""The whole-body deadline: an upload must arrive at a minimum average rate, after a grace.

The rule: the time a route has spent waiting for a body's bytes, in total, may not pass
``grace_s + received / min_bytes_per_s``, where ``received`` is the bytes that have come
so far. A client sending at the minimum rate or faster never meets it; one that trickles
meets it within the grace plus what its bytes bought, however its chunks are spaced (the
no-progress timeout alone let a byte every few seconds hold a place in line for good).

Why the bytes so far and not the declared ``Content-Length``: a declared length is only a
claim, and charging it would buy a trickle ``length / rate`` seconds (9 hours for a
stream declared at 2 GiB) for bytes never sent. At the end of a body the two agree.

Only waits inside ``receive`` count: a route that stops reading on purpose (the image
stream pacing its upload, a model loading before the upload is read) spends its own time,
not the client's. The clock is passed in, so tests run the rule without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from app.errors import RequestTimeout
from app.units import human_bytes


@dataclass(frozen=True)
class UploadPace:
    """The settings' minimum rate (``min_upload_bytes_per_s``) and grace
    (``upload_grace_s``), shared by every upload."""

    min_bytes_per_s: float
    grace_s: float

    def allowed_s(self, received: int) -> float:
        """Seconds of waiting a body that has sent ``received`` bytes has earned."""
        return self.grace_s + received / self.min_bytes_per_s


class BodyDeadline:
    """One body's waits for its bytes, totalled against its ``UploadPace``."""

    def __init__(self, pace: UploadPace, clock: Callable[[], float] = time.monotonic) -> None:
        self.pace = pace
        self.clock = clock
        self.waited_s = 0.0

    def left_s(self, received: int) -> float:
        """How long the next wait may last before the body is too slow (0 or less: now)."""
        return self.pace.allowed_s(received) - self.waited_s

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time spent in the block as time the body made the route wait."""
        start = self.clock()
        try:
            yield
        finally:
            self.waited_s += self.clock() - start

    def too_slow(self, received: int) -> RequestTimeout:
        rate = human_bytes(int(self.pace.min_bytes_per_s))
        return RequestTimeout(
            f"The upload arrived too slowly: {human_bytes(received)} in "
            f"{self.waited_s:.0f} seconds, and vramguard needs at least {rate} a second "
            "(min_upload_bytes_per_s). Check the connection and send it again.")
