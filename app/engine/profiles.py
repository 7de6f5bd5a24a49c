"""Per-model profiles on disk: what warmup measured, reused at the next load.

Profiling a model (timing batch sizes, measuring each one's memory) takes seconds, and
it gives the same answer on the same machine. A profile is stored under a key of the
model, its weights' fingerprint, the device's name, the driver's version and torch's
version; a change to any of them is a different key, so a profile is never trusted
after an update of torch, the driver or the card. Within one key, a profile older than
``MAX_AGE_S`` is still used but measured again in the background (a machine drifts).

Nothing read back is trusted: any program of this user can write the folder. A file
that is not a well-formed profile for its key is ignored (and measured again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.engine.warmup import BatchTiming, WarmupTimings
from app.memory.fit import MemoryFit

log = logging.getLogger("vramguard.engine")
FORMAT = 1
MAX_AGE_S = 30 * 24 * 3600.0
MAX_POINTS = 64
MAX_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class ProfileKey:
    """Everything that, changed, makes a measurement untrustworthy."""

    model: str
    weights_version: str
    device: str
    driver: str
    torch: str
    numerics: str = "fp32"  # what the model runs in: Numerics.label (app.models.precision)

    def file_name(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32] + ".json"


def device_identity(device: torch.device) -> tuple[str, str]:
    """(device name, driver version) of ``device``; the CPU's model name and "none"."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return name, _nvidia_driver() or f"cuda {torch.version.cuda}"
    return f"cpu {_cpu_name()} x{os.cpu_count()}", "none"


def _nvidia_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class ModelProfile:
    """What one model measured on one device."""

    key: ProfileKey
    weights_bytes: int
    fit: MemoryFit
    points: list[tuple[int, int]]
    timings: list[BatchTiming]
    chosen_batch_size: int
    out_of_memory_at: int | None = None
    measured_at: float = field(default_factory=time.time)
    out_of_memory_on_load: bool = False

    @property
    def stale(self) -> bool:
        return time.time() - self.measured_at > MAX_AGE_S

    def footprint_peak(self, batch_size: int | None = None) -> int:
        """The peak of a batch of the chosen size (or ``batch_size``)."""
        return self.fit.peak(batch_size or self.chosen_batch_size)

    def warmup(self, duration_s: float) -> WarmupTimings:
        """The stored timings as a warmup's result (``duration_s``: this load's)."""
        return WarmupTimings(list(self.timings), self.chosen_batch_size, duration_s,
                             self.out_of_memory_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "key": asdict(self.key), "weights_bytes": self.weights_bytes,
            "fixed_bytes": self.fit.fixed_bytes, "bytes_per_sample": self.fit.bytes_per_sample,
            "points": [list(p) for p in self.points],
            "timings": [[t.batch_size, t.seconds] for t in self.timings],
            "chosen_batch_size": self.chosen_batch_size,
            "out_of_memory_at": self.out_of_memory_at, "measured_at": self.measured_at,
            "out_of_memory_on_load": self.out_of_memory_on_load,
        }

    @classmethod
    def from_json(cls, key: ProfileKey, data: Any) -> ModelProfile:
        """Parse and check a stored profile; ValueError when anything is off."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a profile in this format")
        if data.get("key") != asdict(key):
            raise ValueError("a profile of another model, device or version")
        points = [(_count(b), _count(p, zero=True)) for b, p in _pairs(data["points"])]
        timings = [BatchTiming(_count(b), _seconds(s)) for b, s in _pairs(data["timings"])]
        if not points or not timings:
            raise ValueError("no measurements")
        oom_at = data["out_of_memory_at"]
        return cls(
            key=key, weights_bytes=_count(data["weights_bytes"], zero=True),
            fit=MemoryFit(_count(data["fixed_bytes"], zero=True),
                          _count(data["bytes_per_sample"])),
            points=points, timings=timings,
            chosen_batch_size=_count(data["chosen_batch_size"]),
            out_of_memory_at=None if oom_at is None else _count(oom_at),
            measured_at=_seconds(data["measured_at"]),
            out_of_memory_on_load=data["out_of_memory_on_load"] is True)


def _pairs(value: Any) -> list[tuple[Any, Any]]:
    if not isinstance(value, list) or len(value) > MAX_POINTS:
        raise ValueError("not a short list")
    if not all(isinstance(v, list) and len(v) == 2 for v in value):
        raise ValueError("not a list of pairs")
    return [(v[0], v[1]) for v in value]


def _count(value: Any, zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero else 1):
        raise ValueError(f"not a count: {value!r}")
    return value


def _seconds(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"not a time: {value!r}")
    return float(value)


class ProfileStore:
    """A private folder of profiles, one small JSON file each."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def get(self, key: ProfileKey) -> ModelProfile | None:
        path = self.folder / key.file_name()
        try:
            with path.open("rb") as handle:
                text = handle.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read the stored profile %s (%s): measuring again", path,
                        exc.strerror)
            return None
        try:
            if len(text) > MAX_FILE_BYTES:
                raise ValueError("far larger than a profile")
            return ModelProfile.from_json(key, json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError, JSON errors
            log.warning("ignoring the stored profile %s (%s): measuring again", path, exc)
            return None

    def put(self, profile: ModelProfile) -> None:
        """Write atomically (a crash leaves the old file or the new one); a failure to
        write only costs the next start its profiling, so it is logged, not raised."""
        path = self.folder / profile.key.file_name()
        temp: str | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            handle, temp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(profile.to_json(), out)
            os.replace(temp, path)
        except OSError as exc:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            log.warning("cannot store the profile of %s in %s (%s): the next start "
                        "measures it again", profile.key.model, self.folder, exc.strerror)
