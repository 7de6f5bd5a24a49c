"""The loaded models: one frozen ``Runtime`` per model, and ``LoadedModels``, the holder
that every part of the engine shares (the runtimes, their residency and counters, the one
memory probe and the one budget).

The rule it keeps: every model's guard gets the same budget,
``room - sum of the loaded models' weights`` (see ``Budget``), so the holder rebuilds it
whenever a model comes or goes. Mutated on the device thread only; the event loop reads
copies (``dict(holder.runtimes)``) or the engine's view.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.config import Settings
from app.engine.batch_size import AdaptiveBatchSize
from app.engine.batcher import MicroBatcher
from app.engine.oom import OomRecovery, Outcome
from app.engine.predictor import Predictor, Sample
from app.engine.residency import Footprint, Residency
from app.engine.warmup import WarmupTimings
from app.errors import Loading, NotFound, NotReady, Paused
from app.memory.budget import Budget
from app.memory.fit import MemoryFit
from app.memory.guard import MemoryGuard
from app.memory.probes import CpuProbe, MemoryReading, Probe
from app.memory.sharing import GpuSharing, SharingFactory, gpu_sharing
from app.models import LoadedModel, ModelLoadError, torchvision_models
from app.schemas import GuardState

ProbeFactory = Callable[[torch.device, int, int | None], Probe]  # device, weights, CPU cap
Clock = Callable[[], float]
UNLIMITED = 2**62


class Phase(enum.StrEnum):
    STARTING = "starting"
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class Health:
    """Where the engine is in its life, and why it cannot serve when it cannot. A sticky
    CUDA error (``device_lost``) broke the device's context: no restart of it in-process."""

    phase: Phase = Phase.STARTING
    error: str | None = None
    device_lost: bool = False

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def device_failed(self, message: str) -> None:
        """A sticky CUDA error: the engine stops serving, and the process must restart."""
        self.phase, self.error, self.device_lost = Phase.FAILED, message, True

    def not_ready_message(self) -> str:
        if self.phase is Phase.FAILED and self.device_lost:
            return (f"The graphics card stopped working ({self.error}). This vramguard "
                    "cannot use it again, so it exits: the tray starts a new one by itself "
                    "(start it again yourself if you ran vramguard serve). If it happens "
                    "again, restart the computer.")
        if self.phase is Phase.FAILED:
            return f"The model could not be started: {self.error}"
        if self.phase is Phase.STOPPED:
            return "vramguard is shutting down."
        return "vramguard is still starting up (loading and warming up the model)."

    def not_ready(self) -> NotReady:
        return NotReady(self.not_ready_message(), retry_after=5)


def not_loaded(name: str) -> NotReady:
    """The 503 for a model that is known but not loaded now."""
    return NotReady(f"The model {name} is not loaded. Ask for it in a request and vramguard "
                    "loads it.", retry_after=2)


def still_loading(name: str, seconds_left: float) -> Loading:
    """The 503 for a request whose deadline passed while ``name`` was being loaded."""
    seconds = max(1, math.ceil(seconds_left))
    return Loading(f"The model {name} is being loaded; try again in {seconds} s.",
                   retry_after=seconds)


def unknown_model(name: str) -> NotFound:
    """The 404 for a name that is no model this vramguard may load: a torchvision
    architecture whose weights file is not here is told where to put it."""
    try:
        torchvision_models.weights_file(name, None)
    except ModelLoadError as exc:
        if name in torchvision_models.names():
            return NotFound(f"{exc} vramguard never downloads; once the file is there, GET "
                            "/v1/models lists the model and a request loads it.")
    return NotFound(f"There is no model called '{name}' on this computer. GET /v1/models "
                    "lists the models this vramguard can load.")


def paused_error() -> Paused:
    """The 503 while an admin has paused the appliance."""
    return Paused("vramguard is paused. Resume it from the tray or with "
                  "POST /v1/admin/resume.", retry_after=30)


@dataclass(frozen=True)
class MemoryCost:
    """What warmup measured about memory."""

    weights_bytes: int
    overhead_bytes: int
    others_at_start: int
    fit: MemoryFit
    points: list[tuple[int, int]]


@dataclass(frozen=True)
class Runtime:
    """A loaded, warmed-up model and everything measured about it: they exist together."""

    model: LoadedModel
    predictor: Predictor
    probe: Probe
    guard: MemoryGuard
    recovery: OomRecovery
    memory: MemoryCost
    warmup: WarmupTimings
    reused_profile: bool = False
    batch_size: AdaptiveBatchSize | None = None  # None: the size was set by hand
    profile_complete: bool = True  # False: batch size 1 measured, the rest in progress

    @property
    def footprint(self) -> Footprint:
        return Footprint(self.memory.weights_bytes,
                         self.memory.fit.peak(max(1, self.guard.max_batch)))


@dataclass
class ModelOutcomes:
    """Counted per model since start, for /metrics."""

    loads: int = 0
    load_seconds: float = 0.0
    unloads: dict[str, int] = field(default_factory=dict)  # by reason
    requests: Counter[str] = field(default_factory=Counter)  # by outcome: ok, cached
    sizes: Counter[int] = field(default_factory=Counter)  # batches by size


def busy(batcher: MicroBatcher[Sample, Outcome], name: str) -> bool:
    """Whether ``name`` has images waiting or in progress (never evicted nor expired then)."""
    try:
        lane = batcher.lane(name)
    except KeyError:
        return False
    return lane.waiting + lane.in_flight > 0


def weights_bytes(model: LoadedModel) -> int:
    module = model.module
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class LoadedModels:
    """The runtimes by name, their residency and counters, the probe and the budget."""

    def __init__(self, settings: Settings, device: torch.device, make_probe: ProbeFactory,
                 make_sharing: SharingFactory = gpu_sharing) -> None:
        self.settings = settings
        self.device = device
        self._make_probe = make_probe
        self._make_sharing = make_sharing
        # Alone until the probe names the GPU.
        self.sharing = GpuSharing(fraction=settings.memory_fraction)
        self.runtimes: dict[str, Runtime] = {}
        self.residents: dict[str, Residency] = {}
        self.outcomes: dict[str, ModelOutcomes] = {}
        self.probe: Probe | None = None
        self.budget: Budget | None = None
        self.others_at_start: int | None = None
        # Other programs' use when the budget was last computed: that budget's overhead
        # holds it already, so only growth beyond it shrinks the budget.
        self.others_base = 0

    @property
    def primary(self) -> Runtime | None:
        """The ``--model`` one's runtime when it is loaded, else any loaded model's: what
        the device-wide figures (memory report, metrics) are read through."""
        runtimes = dict(self.runtimes)
        return runtimes.get(self.settings.model) or next(iter(runtimes.values()), None)

    def counted(self, name: str) -> ModelOutcomes:
        return self.outcomes.setdefault(name, ModelOutcomes())

    def pinned(self, name: str) -> bool:
        resident = self.residents.get(name)
        return resident is not None and resident.pinned

    def the_probe(self) -> Probe:
        """The one probe of the device, made by the probe factory at the first load."""
        if self.probe is None:
            cap = int(self.settings.cpu_memory_cap) if self.settings.cpu_memory_cap else None
            self.probe = self._make_probe(self.device, 0, cap)
            self.sharing = self._make_sharing(self.settings, self.probe)
            self.sharing.total = self.probe.read().total
            self.sharing.start()
        return self.probe

    def weights_total(self) -> int:
        return sum(r.memory.weights_bytes for r in self.runtimes.values())

    def set_weights(self, total: int) -> None:
        """What stays allocated for the weights of the loaded models, for the probe."""
        probe = self.probe
        if probe is None:
            return
        probe.weights = total
        if isinstance(probe, CpuProbe) and probe.tracker is not None:
            probe.tracker.base = total

    def budget_for(self, reading: MemoryReading, weights: int | None = None) -> Budget:
        """The budget with ``weights`` (default: the loaded models') on the device."""
        assert self.probe is not None
        settings = self.settings
        return Budget(total=reading.total, fraction=settings.memory_fraction,
                      servers=self.sharing.servers,
                      weights=self.weights_total() if weights is None else weights,
                      workspaces=self.probe.workspaces,
                      overhead=max(0, reading.overhead - self.sharing.others_bytes),
                      cap=int(settings.memory_budget) if settings.memory_budget else None)

    def others_now(self, reading: MemoryReading) -> int:
        """What other programs use, less the other vramguards on this GPU (they plan for
        their own share)."""
        return max(0, reading.others - self.sharing.others_bytes)

    def set_backstop(self) -> None:
        """The allocator's own hard limit at this server's share of the device."""
        if self.probe is not None:
            self.probe.set_backstop(self.sharing.share)

    def share(self, budget: Budget) -> None:
        """One budget for every loaded model's guard."""
        self.budget = budget
        for runtime in list(self.runtimes.values()):
            runtime.guard.set_budget(budget)

    def rebase(self, reading: MemoryReading, weights: int | None = None) -> Budget:
        """A budget from a fresh reading, shared by every guard: its overhead holds what
        other programs use now, so their growth is counted from now on (not once in the
        overhead and again as growth since the start)."""
        self.others_base = self.others_now(reading)
        budget = self.budget_for(reading, weights)
        self.share(budget)
        return budget

    def rebudget(self) -> None:
        """The loaded models changed: one budget, with their weights, for every guard."""
        probe = self.probe
        if probe is None:
            return
        self.set_weights(self.weights_total())
        probe.set_baseline()
        self.sharing.refresh()  # who else is on the GPU now, not at the last tick
        self.rebase(probe.read())
        self.set_backstop()

    def room(self) -> int:
        """What the models may take together now (``Budget.room``); unlimited before the
        first model has been measured."""
        return UNLIMITED if self.budget is None else self.budget.room

    def observe(self, usage: int) -> GuardState:
        """Every model's guard sees the device-wide usage; the state is the worst of them."""
        states = [r.guard.observe(usage) for r in list(self.runtimes.values())]
        order = [GuardState.OK, GuardState.HIGH, GuardState.SHEDDING]
        return max(states, key=order.index, default=GuardState.OK)
