"""Sharing one GPU with other vramguards: how many plan for it, and what the others use.

The rule is the budget's (``app.memory.budget``): each of the ``servers`` vramguards on a
GPU plans for ``memory_fraction / servers`` of it. What the others use is left out of this
server's overhead and of other programs' growth where the driver reports memory per
process (NVML on Linux, and on Windows under TCC): otherwise it would be subtracted from a
share that already leaves room for it. Under Windows' WDDM it is not reported; the others'
use then counts as other programs' as well, which only makes each plan for less.

The servers are found by their claims (``app.host.gpu_claims``), read again at each
refresh (once a second, by the memory monitor): a count that changes re-budgets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.config import Settings
from app.host.gpu_claims import Claim, GpuClaims
from app.memory.probes import CudaProbe, Probe
from app.schemas import SharingServer

SharingFactory = Callable[[Settings, Probe], "GpuSharing"]
log = logging.getLogger("vramguard.engine")


class GpuSharing:
    """This server's view of the other vramguards on its GPU."""

    def __init__(self, claims: GpuClaims | None = None,
                 processes: Callable[[], dict[int, int | None]] = dict,
                 fraction: float = 1.0) -> None:
        self.claims = claims
        self.fraction = fraction  # the memory_fraction setting, before it is shared
        self.total = 0  # the device's bytes, set once read (the cap on what others get)
        self.write = True  # False: see the others, claim nothing (doctor)
        self._processes = processes
        self.others: list[Claim] = []
        self.others_bytes = 0  # what the others use, as far as the driver reports it
        self._used: dict[int, int | None] = {}

    @property
    def servers(self) -> int:
        return 1 + len(self.others)

    @property
    def problem(self) -> str | None:
        return None if self.claims is None else self.claims.problem

    def start(self) -> None:
        """Claim the GPU and see who else has."""
        if self.claims is not None and self.write:
            self.claims.claim()
        self.refresh()
        if self.others:
            log.warning("%s", self.describe())

    def refresh(self) -> bool:
        """Read the claims and the others' memory again; True when the number of servers
        changed (the budget must be computed again)."""
        if self.claims is None:
            return False
        before = self.servers
        try:
            claimed = self.claims.others()
        except Exception as exc:  # the folder is other users' input: never stop the tick
            self.claims.problem = f"could not read {self.claims.folder}: {exc}"
            return False
        self._used = self._processes() if claimed else {}
        # Where NVML lists the GPU's processes, a claim counts only for one of them.
        self.others = [c for c in claimed if not self._used or c.pid in self._used]
        # Each other server is credited at most its share: a claim made up for another
        # program (a game) cannot make this one plan for more than the fraction allows.
        most = int(self.total * self.share) if self.total else 0
        self.others_bytes = sum(min(self._used.get(c.pid) or 0, most) for c in self.others)
        return self.servers != before

    @property
    def share(self) -> float:
        """The fraction of the device this server plans for."""
        return self.fraction / self.servers

    def describe(self) -> str:
        """What the log says when the number of servers changes."""
        if not self.others:
            return (f"no other vramguard uses this GPU now: this one plans for "
                    f"{self.share:.0%} of its memory again")
        named = ", ".join(f"process {c.pid} on port {c.port}" for c in self.others)
        return (f"another vramguard uses this GPU ({named}): each of the {self.servers} "
                f"plans for {self.share:.0%} of its memory")

    def listed(self) -> list[SharingServer]:
        """The others, for /v1/memory: process, port and memory where known."""
        return [SharingServer(pid=c.pid, port=c.port, used_bytes=self._used.get(c.pid))
                for c in self.others]

    def release(self) -> None:
        if self.claims is not None:
            self.claims.release()


def gpu_sharing(settings: Settings, probe: Probe) -> GpuSharing:
    """Claims in ``gpu_claims_dir`` on a GPU, the others' memory from NVML's process list;
    alone on the CPU."""
    if not isinstance(probe, CudaProbe):
        return GpuSharing()
    nvml = probe.nvml
    return GpuSharing(GpuClaims(settings.gpu_claims_dir, probe.gpu_id, settings.port),
                      nvml.processes if nvml is not None else dict, settings.memory_fraction)


def gpu_sharing_seen(settings: Settings, probe: Probe) -> GpuSharing:
    """As ``gpu_sharing``, but claiming nothing: doctor's, whose short check must not
    make a running server plan for less."""
    sharing = gpu_sharing(settings, probe)
    sharing.write = False
    return sharing
