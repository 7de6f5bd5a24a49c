"""Response bodies of the v1 API (they also document it in /docs)."""

from __future__ import annotations

import enum

from pydantic import BaseModel, Field

from app.units import human_bytes

# What a model is, in /v1/models and in each live sample alike.
TASK = ("classify, multilabel (every label above a threshold) or embed (image features "
        "only, /v1/embed).")
FORMAT = ("Where it comes from: efficientnet_lite, torchvision, or your model's format "
          "(timm, timm-hf, transformers, torchvision, torchscript, export, onnx).")
LABELS = "How many labels it answers with (0: embed)."


# The memory guard's watermark state (app/memory/guard.py moves it): part of the contract,
# since the tray and the dashboard colour by it. (No docstring: it would enter the schema.)
class GuardState(enum.StrEnum):
    OK = "ok"
    HIGH = "high"
    SHEDDING = "shedding"


class PredictionOut(BaseModel):
    label: str
    index: int
    score: float = Field(description="Probability between 0 and 1.")


class ClassifyResponse(BaseModel):
    model: str
    predictions: list[PredictionOut] = Field(description="The most likely classes, best "
                                             "first; for a multilabel model the same as "
                                             "labels.")
    labels: list[PredictionOut] | None = Field(None, description="A multilabel model only: "
                                               "every label whose score is above the "
                                               "threshold, best first (top_k does not apply).")
    threshold: float | None = Field(None, description="A multilabel model only: the score a "
                                    "label needed.")
    batch_size: int | None = Field(description="Images computed together with this one; "
                                   "null for an answer from the result cache (cached: true), "
                                   "which no batch computed.")
    cached: bool
    timing_ms: dict[str, float]


class EmbedResponse(BaseModel):
    model: str
    dimensions: int
    embedding: list[float] = Field(description="Penultimate-layer features, L2-normalised: "
                                   "the dot product of two is their cosine similarity.")
    batch_size: int | None = Field(description="Images computed together with this one; "
                                   "null when it came from the result cache (cached: true).")
    cached: bool
    timing_ms: dict[str, float]


class BatchTimingOut(BaseModel):
    batch_size: int
    latency_ms: float
    images_per_second: float


class BatchFitOut(BaseModel):
    """The batch time measured in service: seconds = a + b x images."""

    a_ms: float
    b_ms: float
    observations: int


class ModelOut(BaseModel):
    name: str
    state: str = Field(description="loaded, loading, or available (in the catalogue, loaded "
                       "when a request asks for it).")
    family: str
    input_size: int
    installed: bool = Field(description="Whether its weights are on this computer.")
    note: str = Field("", description="Why it cannot load, when it cannot.")
    task: str = Field("classify", description=TASK)
    format: str = Field("", description=FORMAT)
    labels: int = Field(1000, description=LABELS)
    pinned: bool = Field(False, description="Loaded at start and never unloaded to make "
                         "room (--model, --models).")
    keep_alive_s: float | None = Field(None, description="Seconds it stays loaded after its "
                                       "last request (-1: for ever).")
    expires_in_s: float | None = Field(None, description="Seconds until it unloads if no "
                                       "request comes.")
    device: str | None = None
    weights_file: str | None = None
    weights_version: str | None = None
    weights_bytes: int | None = Field(None, description="Measured once loaded (or from its "
                                      "stored profile).")
    fixed_bytes: int | None = Field(None, description="c: memory of one of its batches that "
                                    "does not grow with the batch.")
    bytes_per_sample: int | None = Field(None, description="k: memory per image in a batch.")
    batch_size: int | None = Field(None, description="Batch size in force.")
    max_batch_size: int | None = Field(None, description="The same as batch_size (the name "
                                       "older clients read).")
    images_per_second: float | None = Field(None, description="Measured at its batch size.")
    batch_fit: BatchFitOut | None = None
    profile_reused: bool | None = Field(None, description="Whether its last load reused a "
                                        "stored profile instead of measuring.")
    profile_complete: bool | None = Field(None, description="False while the batch sizes "
                                          "beyond 1 are still being measured in the "
                                          "background (a model loaded while serving); until "
                                          "then it runs one image per batch.")
    warmup_seconds: float | None = None
    warmup: list[BatchTimingOut] = Field(default_factory=list)


class ModelsResponse(BaseModel):
    models: list[ModelOut]


class ErrorBody(BaseModel):
    code: str = Field(description="Stable, for programs: e.g. 503 overloaded (busy: "
                      "Retry-After), loading (the model asked for is being loaded: "
                      "Retry-After), not_ready (vramguard itself is starting).")
    message: str = Field(description="For a person.")


class ErrorResponse(BaseModel):
    error: ErrorBody


class IdentityProof(BaseModel):
    proof: str = Field(description="HMAC-SHA256 of the nonce followed by the server's port "
                       "(two bytes, big-endian), keyed with the admin token, in hex.")


class StatsResponse(BaseModel):
    uptime_s: float
    phase: str
    paused: bool
    queue_depth: int
    in_flight: int
    batches: int
    batched_images: int
    mean_batch_size: float
    largest_batch: int
    expired_in_queue: int
    withdrawn_in_queue: int
    requests: dict[str, int] = Field(description="Answered requests by outcome code.")
    rate_limited: int = Field(description="Requests refused with 429 since start.")
    cache_entries: int | None


class ProfilePoint(BaseModel):
    batch_size: int
    peak_bytes: int = Field(description="Peak memory of one forward pass of this batch size.")


class ModelMemory(BaseModel):
    """One loaded model's share of the device."""

    name: str
    weights_bytes: int
    batch_peak_bytes: int = Field(description="Peak of one of its batches at its batch size "
                                  "(c + k x batch size, measured).")
    batch_size: int
    pinned: bool = Field(description="Loaded at start and never unloaded to make room.")
    task: str = Field("classify", description=TASK)
    format: str = Field("", description=FORMAT)
    labels: int = Field(0, description=LABELS)
    own: bool = Field(False, description="One of your models (from the models folder), "
                      "not a built-in one.")


class GpuProgram(BaseModel):
    """Another program using the GPU, as NVML lists it."""

    pid: int
    name: str
    used_bytes: int | None = Field(description="Its GPU memory; null where the driver does "
                                   "not say (often under Windows' WDDM).")


class SharingServer(BaseModel):
    """Another vramguard on the same GPU (another user's, or on another port)."""

    pid: int
    port: int
    used_bytes: int | None = Field(description="Its GPU memory; null where the driver does "
                                   "not say (often under Windows' WDDM).")


def programs_line(programs: list[GpuProgram], shown: int = 3) -> str:
    """'game.exe 2.0 GiB, chrome.exe (memory unknown) and 2 more', for the tray and doctor."""
    named = [f"{p.name} {human_bytes(p.used_bytes)}" if p.used_bytes is not None
             else f"{p.name} (memory unknown)" for p in programs[:shown]]
    more = len(programs) - shown
    return ", ".join(named) + (f" and {more} more" if more > 0 else "")


class MemoryReport(BaseModel):
    """What ``GET /v1/memory`` answers; the tray, the dashboard and /metrics read these fields."""

    device: str
    source: str = Field(description="Where device figures come from: nvml, torch or system.")
    nvml: bool = Field(description="Whether NVIDIA's management library is answering.")
    total_bytes: int = Field(description="GPU memory: all the memory of the device (without "
                                         "a GPU: of the computer).")
    used_bytes: int = Field(description="Memory in use on the device, all programs.")
    free_bytes: int = Field(description="Free: device memory no program uses.")
    allocated_bytes: int = Field(description="Bytes held by live tensors (Models, Images in "
                                             "progress, workspaces); reserved_bytes less "
                                             "this is the GPU cache.")
    reserved_bytes: int = Field(description="Bytes PyTorch holds: what is used plus the GPU "
                                            "cache (memory it keeps to reuse, which Empty "
                                            "GPU cache gives back).")
    peak_allocated_bytes: int
    peak_reserved_bytes: int = Field(description="Peak: the most vramguard held (Models, "
                                                 "Images in progress and GPU cache) since it "
                                                 "started or since Reset peak.")
    others_bytes: int = Field(description="Other programs: what they use of the GPU memory.")
    other_programs: list[GpuProgram] = Field(
        default_factory=list, description="The other programs NVML lists on the GPU, the "
        "largest first (empty on the CPU or without NVML).")
    weights_bytes: int = Field(description="Models: what the loaded models take.")
    overhead_bytes: int = Field(description="Device memory not held by PyTorch at warmup "
                                            "(context, libraries, other programs).")
    configured_budget_bytes: int
    budget_bytes: int = Field(description="Room for images: the Limit (what Models and "
                                          "Images in progress may take together) less "
                                          "Models, after other programs' use.")
    low_watermark_bytes: int = Field(description="The Getting full line, in Images in "
                                                 "progress: above it the state is high.")
    high_watermark_bytes: int = Field(description="The Full line, in Images in progress: "
                                                  "above it new images wait (shedding).")
    usage_bytes: int = Field(description="Images in progress: what the images being worked "
                                         "on take right now.")
    state: GuardState
    fixed_bytes: int = Field(description="Memory per batch (c): what a batch takes whatever "
                                         "its size.")
    bytes_per_sample: int = Field(description="Memory per image (k): what one more image in "
                                              "a batch takes, now (raised by OOMs).")
    profiled_bytes_per_sample: int = Field(description="k as measured at warmup.")
    profile_points: list[ProfilePoint]
    max_batch_now: int = Field(description="Images that fit in a batch right now.")
    cpu_memory_cap_bytes: int | None
    process_used_bytes: int | None = Field(description="This process's use of the whole "
                                                      "device, where the driver reports it.")
    oom_events: int
    oom_recoveries: int
    oom_failures: int
    state_changes: int
    idle_releases: int
    cache_empties: int
    # Diagnostics; defaults keep the reports of servers that predate them readable.
    fragmentation_releases: int = Field(0, description="Idle periods at which at least half "
                                        "the cache was free space split between blocks in "
                                        "use (fragmented), and the cache was emptied.")
    leak_suspected: bool = Field(False, description="Memory left in use has risen at "
                                 "several idle periods: something keeps tensors alive. "
                                 "Separate from state.")
    leak_growth_bytes: int = Field(0, description="Bytes tensors held at the last idle "
                                   "period beyond what they held after warmup or the last "
                                   "load or unload of a model.")
    idle_baselines_bytes: list[int] = Field(default_factory=list, description="Bytes tensors "
                                            "held beyond the models' weights and the "
                                            "libraries' kept workspaces at the last idle "
                                            "periods since the last load or unload, oldest "
                                            "first.")
    large_allocations: int = Field(0, description="Places logged for a single allocation "
                                   "over large_allocation_bytes beyond a batch's measured "
                                   "need.")
    gpu_utilization_ratio: float | None = Field(None, description="Share of time the GPU ran "
                                                "work (any program's), from NVML; absent on "
                                                "the CPU or without NVML.")
    cpu_instead_of_gpu: str | None = Field(None, description="Why vramguard runs on the CPU "
                                           "although an NVIDIA GPU is present (an old GPU "
                                           "this build cannot use); absent otherwise.")
    sharing_with: list[SharingServer] = Field(
        default_factory=list, description="Other vramguards on this GPU: with them, each "
        "plans for an equal share of memory_fraction (empty when alone or on the CPU).")
    sharing_problem: str | None = Field(None, description="Why other vramguards on this GPU "
                                        "cannot be seen (their folder cannot be written); "
                                        "absent otherwise.")
    models: list[ModelMemory] = Field(default_factory=list, description="The loaded models "
                                      "and what each takes (weights_bytes above is their "
                                      "sum).")


class ServingFigures(BaseModel):
    """What was served, for one model or all of them, over the last moments."""

    images_per_s: float = Field(description="Images answered per second, over the last "
                                "rate_s seconds.")
    answers: int = Field(description="Images answered in the last window_s seconds.")
    p50_ms: float | None = Field(description="Median answer time over the last window_s "
                                 "seconds, to within 5 %; null without answers.")
    p95_ms: float | None = Field(description="95th percentile of the answer time, likewise.")
    refused: dict[str, int] = Field(description="Images refused in the last window_s "
                                    "seconds, by reason: rate_limited, overloaded, "
                                    "bad_input, insufficient_memory, other.")
    refused_per_s: dict[str, float] = Field(description="The same per second, over the "
                                            "last rate_s seconds.")


class ServingReport(BaseModel):
    """The serving of the last moments: in total and per model (those that had requests)."""

    window_s: float
    rate_s: float
    total: ServingFigures
    models: dict[str, ServingFigures]


class LiveSample(MemoryReport):
    """One ``sample`` event of ``GET /v1/events``: the memory report with queue figures."""

    t: float = Field(description="Unix time of the sample.")
    queue_depth: int
    in_flight: int
    batches: int
    mean_batch_size: float
    paused: bool
    requests: dict[str, int]
    rate_limited: int
    serving: ServingReport | None = Field(None, description="Images per second, answer "
                                          "times and refusals of the last minute.")
