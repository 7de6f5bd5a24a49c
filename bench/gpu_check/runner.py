"""The part of the GPU check that keeps a run from being lost, whatever its steps do.

Each step is wrapped (its exception's class and message recorded, the run going on), timed,
limited (SIGALRM), skipped with a reason when it cannot run, and the whole report is
rewritten atomically before and after it. Nothing here imports torch or the app, so the
check can say which import is missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
STICKY = ("illegal memory access", "unspecified launch failure", "device-side assert",
          "misaligned address", "illegal instruction")


@dataclass(frozen=True)
class StepSpec:
    """One step: what it answers (copied into the JSON), and when it cannot run."""

    name: str
    answers: str
    cuda: str = ""  # non-empty: needs CUDA, and why
    needs: tuple[str, ...] = ()
    crash: bool = False  # its failure means the appliance itself would not start
    limit_s: float = 60.0
    min_s: float = 3.0


class Skip(Exception):
    """This step cannot run here; the message says why."""


class StepTimeout(BaseException):
    """The step ran past its time limit. A BaseException, so that the steps' own broad
    ``except Exception`` (one optional reading, one request) cannot swallow it."""


def type_name(exc: object) -> str:
    cls = type(exc)
    name = cls.__qualname__
    return name if cls.__module__ == "builtins" else f"{cls.__module__}.{name}"


def describe(exc: BaseException) -> dict[str, Any]:
    """Class, message and the last frames: enough to act on, without keeping the exception,
    whose traceback would keep the failed step's GPU tensors alive."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return {"type": type_name(exc), "message": str(exc)[:2000],
            "where": [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in frames]}


def is_sticky(exc: BaseException) -> bool:
    """A CUDA error after which nothing more runs on the device in this process."""
    message = str(exc).lower()
    return any(mark in message for mark in STICKY)


def part(out: dict[str, Any], key: str, fn: Callable[[], T]) -> T | None:
    """One optional reading: its value, or its error in its place. Never raises: a driver
    that does not support one query must not cost the others."""
    try:
        value = fn()
    except Exception as exc:
        out[key] = {"error": f"{type_name(exc)}: {str(exc)[:300]}"}
        return None
    out[key] = value
    return value


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed_calls(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """Median, p90 and worst microseconds of ``calls`` calls."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e6)
    return {"calls": calls, "median_us": round(statistics.median(times), 1),
            "p90_us": round(percentile(times, 0.9), 1), "max_us": round(max(times), 1)}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically, so a run killed mid-write keeps the previous complete version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """StepTimeout in the main thread after ``seconds`` (where SIGALRM exists): a hung step
    costs its limit, not the run."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise StepTimeout(f"the step ran past its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Steps:
    """Runs steps so that none can lose the run: each one wrapped, timed and limited, and
    the whole report rewritten before and after it."""

    def __init__(self, report: dict[str, Any], write: Callable[[], None], budget_s: float,
                 counters: Callable[[], dict[str, int]] = dict) -> None:
        self.report = report
        self.write = write
        self.budget_s = budget_s
        self.counters = counters
        self.started = time.monotonic()
        self.current = ""
        self.cuda_broken: str | None = None
        self.only: frozenset[str] | None = None  # --only: the steps a rerun runs
        report.setdefault("steps", {})

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def skip_reason(self, spec: StepSpec, dry: bool) -> str | None:
        if self.only is not None and spec.name not in self.only:
            return "not asked for in this rerun (--only)"
        if spec.cuda and dry:
            return f"needs CUDA ({spec.cuda}); this is the dry mode, on a machine without a GPU"
        if self.cuda_broken and spec.name != "final":
            return (f"the CUDA context broke in step '{self.cuda_broken}' (a sticky error): "
                    "nothing more runs on this GPU in this process")
        for dep in spec.needs:
            status = self.report["steps"].get(dep, {}).get("status", "did not run")
            if status != "ok":
                return f"needs step '{dep}', which {'was ' if status == 'skipped' else ''}{status}"
        if spec.min_s and self.remaining() < spec.min_s:
            return (f"out of time: {max(0.0, self.remaining()):.0f} s left of the "
                    f"{self.budget_s:.0f} s budget, the step needs about {spec.min_s:.0f} s")
        return None

    def run(self, spec: StepSpec, fn: Callable[[dict[str, Any]], str | None],
            dry: bool = False) -> dict[str, Any]:
        record: dict[str, Any] = {"answers": spec.answers, "status": "running"}
        self.report["steps"][spec.name] = record
        reason = self.skip_reason(spec, dry)
        if reason:
            record.update(status="skipped", reason=reason)
            self.write()
            return record
        self.write()
        self.current = spec.name
        result: dict[str, Any] = {}
        record["result"] = result
        before = self.counters()
        started = time.perf_counter()
        try:
            with time_limit(min(spec.limit_s, max(1.0, self.remaining()))):
                summary = fn(result)
            record["status"] = "ok"
            if summary:
                record["summary"] = summary
        except Skip as exc:
            record.update(status="skipped", reason=str(exc))
        except (Exception, StepTimeout) as exc:
            record.update(status="failed", error=describe(exc))
            if is_sticky(exc):
                self.cuda_broken = spec.name
        except BaseException:
            record["status"] = "interrupted"
            raise
        finally:
            record["seconds"] = round(time.perf_counter() - started, 3)
            after = self.counters()
            if before and after:
                record["memory_stats"] = {
                    "before": before, "after": after,
                    "delta": {k: after[k] - before.get(k, 0) for k in after}}
            self.current = ""
            self.write()
        return record


class LogCollector(logging.Handler):
    """vramguard's own log lines (which memory source, PID match, OOMs, state changes) go
    into the JSON, tagged with the step, instead of cluttering the summary."""

    def __init__(self, steps: Steps, records: list[dict[str, str]]) -> None:
        super().__init__(logging.INFO)
        self.steps = steps
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < 300:
            self.records.append({"step": self.steps.current, "level": record.levelname,
                                 "logger": record.name, "message": record.getMessage()[:500]})


def is_sticky_record(record: dict[str, Any]) -> bool:
    return any(mark in record.get("error", {}).get("message", "").lower() for mark in STICKY)


def summary(report: dict[str, Any]) -> list[str]:
    """One screen: a line per step, then what failed and what to read."""
    steps = report["steps"]
    versions = steps.get("versions", {}).get("result", {})
    nvml = steps.get("nvml", {}).get("result", {})
    device = report.get("device_name") or ("a GPU" if report["mode"] == "cuda" else "the CPU")
    lines = [f"vramguard GPU check ({report['mode']}) on {device}: "
             f"torch {report.get('torch_version')}, CUDA {versions.get('cuda_build')}, cuDNN "
             f"{versions.get('cudnn_version')}, driver {nvml.get('driver_version', '-')}; "
             f"{report.get('elapsed_s')} s"]
    for name, record in steps.items():
        status = record["status"]
        if status == "ok":
            text = record.get("summary", "")
        elif status == "failed":
            text = f"{record['error']['type']}: {record['error']['message']}"
        else:
            text = record.get("reason", "")
        seconds = record.get("seconds")
        took = f"{seconds:6.1f}s" if isinstance(seconds, float | int) else "       "
        lines.append(f"  {name:<14} {status:<8}{took}  {' '.join(text.split())}"[:118])
    for title, items in (("FAILURES", report["failures"]), ("warnings", report["warnings"])):
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines.extend(f"  - {item['step']}: {item['detail']}"[:118] for item in items[:6])
            if len(items) > 6:
                lines.append(f"  ... {len(items) - 6} more in the JSON")
    if report.get("could_not_run"):
        lines.append(f"could not run: {report['could_not_run']}"[:118])
    lines.append(f"JSON: {report.get('out')}")
    lines.append(f"GPU CHECK {report['verdict'].upper()} (exit {report['exit_code']})")
    return lines
