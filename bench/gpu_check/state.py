"""What the steps share: the report, what they hand on to each other, and the readings.

A ``Check`` holds the run's state (the engine, the warmed runtime, measurements), so each
step module is a set of functions over it. Nothing here imports torch or the app at import
time: the imports step must be able to say which one is missing, so each use imports it
where it runs, after that step passed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bench.gpu_check.plan import (
    COUNTERS,
    DRY_DEFAULT_OUT,
    DRY_PLAN,
    GPU_PLAN,
    REAL_RUN_FILE,
    ROOT,
    MiB,
    Plan,
)
from bench.gpu_check.runner import Steps, part, write_json

if TYPE_CHECKING:
    import numpy as np
    import torch

    from app.config import Settings
    from app.engine.engine import InferenceEngine, Runtime
    from app.engine.predictor import Sample
    from app.memory.fit import MemoryFit
    from app.models import LoadedModel


@dataclass(frozen=True)
class Nvml:
    """pynvml (untyped) and the handle of the GPU this run measures, set together by the
    nvml step, so a reading needs one check that NVML is there."""

    lib: ModuleType
    handle: object

    def used(self) -> int | None:
        try:
            return int(self.lib.nvmlDeviceGetMemoryInfo(self.handle).used)
        except Exception:
            return None

    def process_used(self) -> int | None:
        for proc in self.lib.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None


class Check:
    """The run's state, and the readings and verdicts every step uses."""

    def __init__(self, args: argparse.Namespace, gpu_plan: Plan = GPU_PLAN) -> None:
        self.args = args
        self.gpu_plan = gpu_plan  # the run's size where there is CUDA
        self.dry = bool(args.dry or args.device == "cpu")
        self.plan = DRY_PLAN
        self.out: Path | None = None
        self.report: dict[str, Any] = {
            "schema": 1, "tool": "bench/gpu_check", "mode": "unknown",
            "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "python": sys.version.split()[0], "torch_version": None,
            "stages": {}, "steps": {}, "failures": [], "warnings": [], "log": []}
        self.steps = Steps(self.report, self.write, DRY_PLAN.budget_s, self.counters)
        self.started = time.monotonic()
        self.import_failed = False
        self.could_not_run: str | None = None
        self.has_torch = False
        self.pynvml: ModuleType | None = None
        self.nvml: Nvml | None = None
        self.device = "cpu"
        self.dev: torch.device | None = None
        self.cuda_ready = False
        self.found_engine: InferenceEngine | None = None
        self.found_model: LoadedModel | None = None
        self.found_runtime: Runtime | None = None
        self.tried: list[int] = [1]
        self.chosen = 1
        self.increases: dict[int, int] | None = None
        self.photos: dict[tuple[int, int], np.ndarray] = {}  # the espresso photo per size
        self.model_fits: dict[str, MemoryFit] = {}
        self.stand_ins: dict[str, str] = {}  # models made here, not carried: what was made
        self.workdir = Path(tempfile.mkdtemp(prefix="vramguard-gpu-check-"))
        self._engines = 0  # engines made: each gets its own profile folder
        self.config_file = self.workdir / "config.toml"
        self.config_file.write_text("")  # the defaults, whatever this user's config says

    # -- what the steps hand on: set by load and warmup, which the later steps need -------

    @property
    def engine(self) -> InferenceEngine:
        if self.found_engine is None:
            raise RuntimeError("no engine: the load step did not run")
        return self.found_engine

    @property
    def model(self) -> LoadedModel:
        if self.found_model is None:
            raise RuntimeError("no model: the load step did not run")
        return self.found_model

    @property
    def runtime(self) -> Runtime:
        if self.found_runtime is None:
            raise RuntimeError("no runtime: the warmup step did not run")
        return self.found_runtime

    # -- the report ------------------------------------------------------------------------

    def write(self) -> None:
        if self.out is not None:
            write_json(self.out, self.report)

    def fail(self, kind: str, step: str, detail: str) -> None:
        """A failure of the promise: exits 1."""
        self.report["failures"].append({"kind": kind, "step": step, "detail": detail})

    def warn(self, step: str, detail: str) -> None:
        """Worth reading, but not a failure of the promise."""
        self.report["warnings"].append({"step": step, "detail": detail})

    def resolve(self) -> None:
        """Mode and output file, once torch says whether there is a GPU."""
        if self.has_torch and not self.dry:
            import torch

            available = torch.cuda.is_available()
            if self.args.device == "auto":
                self.dry = not available
            elif not available:
                self.could_not_run = (f"--device {self.args.device}, but torch sees no GPU "
                                      "(use --dry for the CPU dry mode)")
        self.device = "cpu" if self.dry else (
            "cuda" if self.args.device == "auto" else self.args.device)
        self.plan = DRY_PLAN if self.dry else self.gpu_plan
        overrides = {"max_batch": self.args.max_batch_size, "seconds": self.args.seconds,
                     "budget_s": self.args.budget_s}
        self.plan = Plan(**{**asdict(self.plan),
                            **{k: v for k, v in overrides.items() if v is not None}})
        self.steps.budget_s = self.plan.budget_s
        self.report["mode"] = ("dry-cpu" if self.dry else "cuda" if self.has_torch
                               else "unknown (no torch)")
        self.report["plan"] = asdict(self.plan)
        if self.dry and self.args.out is not None and self.args.out.resolve() == REAL_RUN_FILE:
            # docs/gpu-check.json holds a real GPU run: the dry mode never writes it.
            self.could_not_run = (f"refusing to write {REAL_RUN_FILE.relative_to(ROOT)} in the "
                                  "dry mode: it holds a real GPU run; pass another --out")
        self.out = output_path(self.args.out, self.dry, known=self.has_torch)
        self.report["out"] = str(self.out)

    # -- readings --------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """The allocator's counters, read around every step."""
        if not self.cuda_ready or self.steps.cuda_broken:
            return {}
        import torch

        try:
            stats = torch.cuda.memory_stats(self.dev)
        except Exception:
            return {}
        return {key: int(stats[key]) for key in COUNTERS if key in stats}

    def stage(self, name: str, out: dict[str, Any] | None = None) -> dict[str, Any]:
        """Memory as NVML, CUDA and the OS see it now; never raises."""
        reading: dict[str, Any] = {"at_s": round(time.monotonic() - self.started, 2)}
        with contextlib.suppress(Exception):
            import psutil

            reading["rss_bytes"] = int(psutil.Process().memory_info().rss)
            if self.dry:
                memory = psutil.virtual_memory()
                reading["system_used_bytes"] = int(memory.total - memory.available)
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                info = self.nvml.lib.nvmlDeviceGetMemoryInfo(self.nvml.handle)
                reading.update(nvml_used_bytes=int(info.used), nvml_free_bytes=int(info.free))
                reading["nvml_process_bytes"] = self.nvml.process_used()
        if self.cuda_ready and not self.steps.cuda_broken:
            with contextlib.suppress(Exception):
                import torch

                cuda, dev = torch.cuda, self.dev
                free, total = cuda.mem_get_info(dev)
                reading.update(allocated_bytes=cuda.memory_allocated(dev),
                               reserved_bytes=cuda.memory_reserved(dev),
                               max_allocated_bytes=cuda.max_memory_allocated(dev),
                               max_reserved_bytes=cuda.max_memory_reserved(dev),
                               cuda_used_bytes=total - free, cuda_free_bytes=free)
        self.report["stages"][name] = reading
        if out is not None:
            out["memory"] = reading
        return reading

    def nvml_used(self) -> int | None:
        return None if self.nvml is None else self.nvml.used()

    def device_memory(self, engine: InferenceEngine) -> dict[str, int]:
        """What this process holds on the device now: the caching allocator's figures on
        CUDA; on the CPU the engine probe's count (the weights of the loaded models) and RSS."""
        if self.cuda_ready:
            import torch

            cuda, dev = torch.cuda, self.dev
            cuda.synchronize(dev)
            return {"allocated": int(cuda.memory_allocated(dev)),
                    "reserved": int(cuda.memory_reserved(dev))}
        import psutil

        probe = engine.probe
        return {"allocated": 0 if probe is None else int(probe.read().allocated),
                "rss": int(psutil.Process().memory_info().rss)}

    def per_process(self) -> dict[str, Any]:
        """Whether NVML's process list knows this process by its PID: in a container NVML
        reports host PIDs, and the per-process figure is then lost."""
        out: dict[str, Any] = {"pid": os.getpid()}
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    out["nspid"] = [int(p) for p in line.split()[1:]]
        nvml = self.nvml
        if nvml is None:
            out["nvml"] = "not available"
            return out
        procs = part(out, "nvml_processes", lambda: [
            {"pid": p.pid, "used_bytes": p.usedGpuMemory}
            for p in nvml.lib.nvmlDeviceGetComputeRunningProcesses(nvml.handle)])
        if procs is not None:
            out["matched"] = any(p["pid"] == os.getpid() for p in procs)
            if not out["matched"] and procs:
                out["note"] = ("NVML lists other PIDs: a PID namespace (container) shows host "
                               "PIDs, so matching by os.getpid() fails")
        return out

    def flags(self) -> dict[str, Any]:
        """cudnn.benchmark and the TF32 switches, which change memory, speed and scores."""
        import torch

        backends = torch.backends
        out: dict[str, Any] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TF32 switches' newer API warns on the old
            part(out, "cudnn_enabled", lambda: backends.cudnn.enabled)
            part(out, "cudnn_benchmark", lambda: backends.cudnn.benchmark)
            part(out, "cudnn_deterministic", lambda: backends.cudnn.deterministic)
            part(out, "matmul_allow_tf32", lambda: backends.cuda.matmul.allow_tf32)
            part(out, "cudnn_allow_tf32", lambda: backends.cudnn.allow_tf32)
            part(out, "float32_matmul_precision", torch.get_float32_matmul_precision)
            part(out, "matmul_fp32_precision", lambda: backends.cuda.matmul.fp32_precision)
            part(out, "cudnn_fp32_precision", lambda: backends.cudnn.fp32_precision)
        return out

    # -- what the steps run on -------------------------------------------------------------

    @property
    def cuda(self) -> bool:
        return not self.dry

    def sync(self) -> None:
        if self.cuda_ready:
            import torch

            torch.cuda.synchronize(self.dev)

    def samples(self, n: int) -> list[Sample]:
        """n inputs of the model's shape from one randn (n small ones cost 1.6 ms each)."""
        import torch

        from app.engine.predictor import Sample

        crop = self.model.preprocessing.crop
        return [Sample(pixels, 5) for pixels in torch.randn(n, 3, crop, crop).unbind(0)]

    def settings(self, **overrides: Any) -> Settings:
        """An engine's settings; each engine its own profile folder under the check's
        temporary one, so that no step reuses what warmup (or a run before on this
        machine) measured and a rerun measures again."""
        from app.config import load_settings

        self._engines += 1
        # fp32 NCHW whatever the environment says: the precision step's reference. The
        # check's engines claim the GPU in a folder of their own (one process, one plan).
        values = {"device": self.device, "model": self.args.model, "cache": False,
                  "idle_release_s": 0, "precision": "fp32", "channels_last": False,
                  "gpu_claims_dir": self.workdir / "gpu-claims",
                  "profile_dir": self.workdir / f"profiles-{self._engines}", **overrides}
        return load_settings(self.config_file, **values)

    def filler(self, nbytes: int) -> torch.Tensor | None:
        """A tensor holding ``nbytes`` of the device, or a little less where it is fragmented."""
        import torch

        for _ in range(8):
            if nbytes <= 0:
                return None
            try:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
            except torch.OutOfMemoryError:
                pass
            nbytes -= 64 * MiB
        return None


def output_path(given: Path | None, dry: bool, known: bool) -> Path:
    """Where the JSON goes: docs/gpu-check.json by default for a GPU run, elsewhere dry."""
    if given is None:
        return REAL_RUN_FILE if known and not dry else DRY_DEFAULT_OUT
    given = given.resolve()
    return DRY_DEFAULT_OUT if given == REAL_RUN_FILE and (dry or not known) else given
