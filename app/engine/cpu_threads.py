"""How many threads a forward pass on the CPU may use: whichever of "every core" and "one
core fewer" has been measured faster lately, for a lone image and for one while other
images are being read, decoded or wait in line, judged apart.

A forward pass splits each operation across its threads and waits for the slowest. When
the HTTP work, the decode processes and the clients compete for the same cores, one of
those threads is often not running, and the others wait for it: on 2 cores under heavy
overload (hundreds of clients, large photos), one thread fewer answered at the same rate
for 1.4 ms of CPU per answer instead of 2.0, and a 2-thread pass stalled at every
barrier. Under lighter competition (8 clients, small photos: a few short decodes per
batch) every core wins instead: 17-20 ms per image against 23-26 with one thread fewer,
and the rule "one fewer whenever anything else is in progress" made an image stream 5 %
slower than separate requests only because it kept an image in progress more often.
Neither count is right for every load, so the device thread measures both: it keeps the
last few batch times for each model, batch size and thread count, uses the faster, and
gives the other one batch in ``EXPLORE_EVERY`` (16) so the choice follows the load. A lone
image on a quiet computer is answered fastest with every core (23 ms against 28 ms with one
on 2 cores); but other programs compete too, which nothing inside vramguard sees: on the
shared 2-core test machine, busy with two CPU hogs and other tests, an EfficientNet-Lite2
image took 0.7-3.6 s with both threads and 0.09-0.13 s with one. So lone images are
measured the same way (one fewer first: the safe side), and the measuring passes of a load
made while serving run with one core fewer (``for_measuring_while_serving``). Only the
device thread calls this; on a GPU the threads do not matter and nothing changes.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

WINDOW = 5  # batch times kept per model, batch size and thread count: the median of these
TRIED = 3  # batch times a count needs (for that model and batch size) before it is judged
EXPLORE_EVERY = 16  # one busy batch in this many goes to the count not in favour (it costs
# 1/16 of the difference; the favoured count slowing down is seen at once, the other
# speeding up after TRIED of these)


Key = tuple[str, int, int, bool]  # model, images, threads, other images in progress


class CpuThreads:
    """Sets torch's intra-op threads before each batch, when the wanted number changes, and
    learns from each batch's time which number to want."""

    def __init__(self) -> None:
        self.current = torch.get_num_threads()  # the physical cores, or OMP_NUM_THREADS
        self.alone = self.current
        self.shared = max(1, self.alone - 1)
        self.times: dict[Key, deque[float]] = {}
        self.batches = 0
        self.trial: Key | None = None  # the running batch's key

    def fit(self, others_busy: bool, model: str, images: int) -> int:
        """The faster count lately for such a batch (the other now and then). ``record``
        must follow with the batch's time."""
        if self.shared != self.alone:
            wanted = self._choose(model, images, others_busy)
            self.trial = (model, images, wanted, others_busy)
        else:
            wanted, self.trial = self.alone, None
        self._set(wanted)
        return wanted

    def for_measuring_while_serving(self) -> None:
        """One core fewer, for a load's measuring passes while the appliance serves (other
        programs, decoding, clients share the cores; between batches: none is running)."""
        self.trial = None
        self._set(self.shared)

    def _set(self, wanted: int) -> None:
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def record(self, seconds: float | None) -> None:
        """The batch just fitted took ``seconds`` (None: it does not count, e.g. an
        out-of-memory recovery split it)."""
        if self.trial is not None and seconds is not None and seconds > 0:
            self.times.setdefault(self.trial, deque(maxlen=WINDOW)).append(seconds)
        self.trial = None

    def _choose(self, model: str, images: int, others_busy: bool) -> int:
        self.batches += 1
        counts = (self.shared, self.alone)  # one fewer first: the safe side under overload
        seen = {n: self.times.get((model, images, n, others_busy), ()) for n in counts}
        untried = [n for n in counts if len(seen[n]) < TRIED]
        if untried:
            return min(untried, key=lambda n: len(seen[n]))
        best, other = sorted(counts, key=lambda n: statistics.median(seen[n]))
        return other if self.batches % EXPLORE_EVERY == 0 else best
