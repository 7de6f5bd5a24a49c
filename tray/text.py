"""Words for the tooltip and the menu, for a person who is not an ML engineer."""

from __future__ import annotations

from dataclasses import dataclass

from app.schemas import LiveSample, ModelMemory, programs_line
from app.units import human_bytes
from app.vocabulary import (
    GPU_CACHE,
    IMAGES,
    LIMIT,
    MODELS,
    PEAK,
    ROOM_FOR_IMAGES,
    STATE_WORDS,
    USED,
)
from tray.icon import Gauge

TOOLTIP_LIMIT = 127  # Windows truncates tray tooltips beyond this
NOTIFICATION_LIMIT = 255
"""Characters a notification's text may have: Windows keeps 256 with the terminator
(``szInfo``), and pystray raises ValueError beyond it, so the message never showed."""


def fit_notification(message: str, limit: int = NOTIFICATION_LIMIT) -> str:
    """``message``, cut at a word to ``limit`` characters with "…" when it is longer (the
    whole of it goes to the tray's log)."""
    if len(message) <= limit:
        return message
    cut = message[:limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,.;:") + "…"


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 1.0


def _limit(sample: LiveSample) -> int:
    """The Limit: what Models and Images in progress may take together."""
    return sample.weights_bytes + sample.budget_bytes


def _used(sample: LiveSample) -> int:
    return sample.weights_bytes + sample.usage_bytes


def gauge_of(sample: LiveSample | None) -> Gauge:
    """The icon's gauge from a live sample, in shares of the Limit; None means down."""
    if sample is None:
        return Gauge(0.0, 0.0, 0.75, 0.9, "down")
    limit = _limit(sample)
    return Gauge(
        used=min(1.0, _share(_used(sample), limit)),
        peak=min(1.0, _share(sample.peak_reserved_bytes, limit)),
        low=_share(sample.weights_bytes + sample.low_watermark_bytes, limit),
        high=_share(sample.weights_bytes + sample.high_watermark_bytes, limit),
        state=sample.state.value)


def tooltip(sample: LiveSample | None) -> str:
    """e.g. 'vramguard: healthy, 38% of the limit used, peak 61%, GPU 40% busy' (at most
    127 characters; the GPU part only where NVML reports it)."""
    gauge = gauge_of(sample)
    if sample is None:
        text = "vramguard: not running"
    else:
        text = (f"vramguard: {STATE_WORDS.get(gauge.state, gauge.state)}, "
                f"{gauge.used:.0%} of the {LIMIT.name.lower()} used, "
                f"{PEAK.name.lower()} {gauge.peak:.0%}")
        if sample.gpu_utilization_ratio is not None:
            text += f", GPU {sample.gpu_utilization_ratio:.0%} busy"
        if sample.paused:
            text += " (paused)"
    return text[:TOOLTIP_LIMIT]


def menu_lines(sample: LiveSample | None) -> list[str]:
    """The live, read-only lines at the top of the tray menu, in the names of
    ``app/vocabulary.py``."""
    if sample is None:
        return ["vramguard is not running"]
    gauge = gauge_of(sample)
    limit = _limit(sample)
    used = human_bytes(_used(sample))
    gpu_cache = max(0, sample.reserved_bytes - sample.allocated_bytes)
    lines = [
        f"{USED.name}: {used} of the {human_bytes(limit)} {LIMIT.name.lower()} "
        f"({gauge.used:.0%})" if sample.budget_bytes > 0 else
        f"{USED.name}: {used}; no {ROOM_FOR_IMAGES.name.lower()} left (other programs "
        "hold the GPU memory)",
        f"{MODELS.name} {human_bytes(sample.weights_bytes)}, {IMAGES.name.lower()} "
        f"{human_bytes(sample.usage_bytes)}, {GPU_CACHE.name} {human_bytes(gpu_cache)}",
        f"{PEAK.name}: {human_bytes(sample.peak_reserved_bytes)} ({gauge.peak:.0%})",
        f"State: {STATE_WORDS.get(gauge.state, gauge.state)}",
        f"Waiting: {sample.queue_depth}, batch up to {sample.max_batch_now}",
    ]
    if sample.gpu_utilization_ratio is not None:
        lines.append(f"GPU busy: {sample.gpu_utilization_ratio:.0%} of the time (all programs)")
    if sample.other_programs:
        lines.append(f"Other programs: {programs_line(sample.other_programs)}")
    if sample.leak_suspected:
        lines.append(f"Possible leak: {human_bytes(sample.leak_growth_bytes)} more kept "
                     "than at start")
    if sample.cpu_instead_of_gpu:
        lines.append("Using the CPU: update the NVIDIA driver" if "driver" in
                     sample.cpu_instead_of_gpu else
                     "Using the CPU: this GPU is too old for this version")
    if sample.paused:
        lines.append("Paused: images are refused until you resume")
    return lines


MODELS_HEADING = "Models in memory:"
USE_PAGE_ITEM = "Use it from your app"
SUPPORT_REPORT_ITEM = "Save a support report"
SUPPORT_REPORT_SAVED = ("Saved a support report to {path}. Attach it to your bug report: it "
                        "holds the logs, the checks and the settings, not the admin token.")
USE_PAGE_DOWN = "vramguard is not running, so it cannot show how to use it. Start it first."
READY = "vramguard is ready: {address}"
GPU_RESTARTED = ("The graphics card stopped working (a driver reset or update can do that), "
                 "so vramguard started again to use it afresh.")
STARTING_NOTICE = ("vramguard is starting. The first start can take a few minutes; a "
                   "notification says when it is ready.")
STILL_STARTING = ("vramguard is already starting (the first start can take a few minutes). "
                  "A notification says when it is ready.")
UNLOADED = ("{name} is no longer in memory ({size} freed). It loads again the next time an "
            "image asks for it.")
UNLOAD_BUSY = ("{name} is working on images right now, so it stays in memory. Try again when "
               "they are done.")
UNLOAD_GONE = "{name} was not in memory any more: there was nothing to unload."


@dataclass(frozen=True)
class ModelEntry:
    """One loaded model in the tray menu: its name, the line that says what it takes, and
    the words of its Unload item."""

    name: str
    label: str
    unload: str
    weights_bytes: int


def is_own(model: ModelMemory) -> bool:
    """Whether ``model`` is one the person brought (``vramguard models add``)."""
    return model.own


def own_model_words(model: ModelMemory) -> str:
    """What an own model is, e.g. 'your model (timm, multilabel, 12 labels)' or 'your
    model (onnx, image features)', the words of the README's 'Serve your own model'."""
    if model.task == "embed":
        what = [model.format, "image features"]
    else:
        count = f"{model.labels} label{'' if model.labels == 1 else 's'}"
        what = [model.format, *(["multilabel"] if model.task == "multilabel" else []), count]
    return f"your model ({', '.join(what)})"


def model_entries(sample: LiveSample | None) -> list[ModelEntry]:
    """The models the server has in memory, e.g. 'efficientnet_lite1 — 21 MiB (+ 160 MiB
    while working)', an own one with what it is first ('shapes — your model (onnx, 3
    labels), 4 MiB (+ ...)'); ', kept loaded' for the ones it never unloads to make
    room."""
    if sample is None:
        return []
    entries = []
    for model in sample.models:
        size = human_bytes(model.weights_bytes)
        own = f"{own_model_words(model)}, " if is_own(model) else ""
        label = (f"{model.name} — {own}{size} (+ {human_bytes(model.batch_peak_bytes)} "
                 "while working)")
        if model.pinned:
            label += ", kept loaded"
        entries.append(ModelEntry(model.name, label, f"Unload (frees {size})",
                                  model.weights_bytes))
    return entries


class Notifier:
    """Says something when memory enters 'high' or 'shedding', and when a leak is
    suspected: once per episode.

    A memory episode ends when the state is back to 'ok'; a leak episode when the
    server no longer suspects one. A leak does not change the state (or the icon's
    colour): memory may still be well within the budget.
    """

    def __init__(self) -> None:
        self._warned: str | None = None
        self._leak_warned = False

    def leak(self, suspected: bool, growth: int) -> str | None:
        if not suspected:
            self._leak_warned = False
            return None
        if self._leak_warned:
            return None
        self._leak_warned = True
        return (f"vramguard keeps {human_bytes(growth)} more memory after each quiet spell "
                "than when it started: something is holding on to old work. Restarting "
                "vramguard gives that memory back.")

    def update(self, state: str) -> str | None:
        if state == "ok" or state == "down":
            self._warned = None
            return None
        if self._warned == "shedding" or self._warned == state:
            return None
        self._warned = state
        if state == "shedding":
            return ("vramguard's memory is full: new images wait until others finish. "
                    "Closing other programs that use the graphics card will help.")
        return "vramguard's memory is getting full: new images will wait if it keeps rising."
