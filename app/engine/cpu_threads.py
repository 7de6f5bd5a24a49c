"""How many threads a forward pass on the CPU may use: every core for a lone image, one
core fewer while other images are being read, decoded or wait in line.

A forward pass splits each operation across its threads and waits for the slowest. When
the HTTP work, the decode processes and the clients compete for the same cores, one of
those threads is often not running, and the others wait for it: on 2 cores under
overload, two threads cost 2.0 ms of CPU per answer where one costs 1.4 ms, for the
same throughput. A lone image, with nothing else running, is answered fastest with all
of them (23 ms against 28 ms with one thread on 2 cores). Only the device thread calls
this; on a GPU the threads do not matter and nothing changes.
"""

from __future__ import annotations

import torch


class CpuThreads:
    """Sets torch's intra-op threads before each batch, when the wanted number changes."""

    def __init__(self) -> None:
        self.current = torch.get_num_threads()  # the physical cores, or OMP_NUM_THREADS
        self.alone = self.current
        self.shared = max(1, self.alone - 1)

    def fit(self, others_busy: bool) -> int:
        """Use ``shared`` threads while other images are in progress, else ``alone``."""
        wanted = self.shared if others_busy else self.alone
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
        return wanted
