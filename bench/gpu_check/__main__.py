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
import faulthandler
import functools
import logging
import shutil
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.gpu_check import (
    device,
    memory,
    models,
    oom,
    own_models,
    precision,
    server_path,
    speed,
)
from bench.gpu_check.plan import (
    CUDA_ONLY,
    DRY_DEFAULT_OUT,
    DRY_PLAN,
    GPU_PLAN,
    PROMISE_STEPS,
    REAL_RUN_FILE,
    ROOT,
    SPECS,
    STEPS,
    selected,
)
from bench.gpu_check.prepare import WHEEL_DIR, prepare
from bench.gpu_check.runner import LogCollector, is_sticky_record, summary
from bench.gpu_check.state import Check

# What runs each step of the plan, by its name.
RUNS: dict[str, Callable[[Check, dict[str, Any]], str]] = {
    "imports": device.imports, "versions": device.versions, "nvml": device.nvml,
    "cuda_context": device.cuda_context, "load": memory.load,
    "first_forward": memory.first_forward, "warmup": memory.warmup,
    "empty_cache": memory.empty_cache, "batch_peaks": memory.batch_peaks,
    "split_timings": speed.split_timings, "throughput": speed.throughput,
    "precision": precision.precision, "tick_cost": speed.tick_cost,
    "snapshot_cost": speed.snapshot_cost,
    "latency_p50": speed.latency_p50, "forced_oom": oom.forced_oom,
    "server_path": server_path.server_path, "pressure_oom": oom.pressure_oom,
    "multi_model": models.multi_model, "own_models": own_models.own_models,
    "final": memory.final,
}


def run(check: Check) -> int:
    """Every step of the plan in order, then the verdict."""
    # The last resort for a hang in C code, which no signal interrupts: the JSON written
    # so far stays, with the hung step marked "running".
    faulthandler.dump_traceback_later(check.steps.budget_s + 120, exit=True)
    logger = logging.getLogger("vramguard")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(LogCollector(check.steps, check.report["log"]))
    for spec in SPECS:
        record = check.steps.run(spec, functools.partial(RUNS[spec.name], check), dry=check.dry)
        if spec.name == "imports":
            check.resolve()
            # Before bench/gpu_check_device.sh's `timeout` (budget + 35 s), so that a hang
            # in C code is shown where it is.
            faulthandler.dump_traceback_later(check.plan.budget_s + 25, exit=True)
            check.write()
            if check.import_failed or check.could_not_run:
                break
        elif spec.name == "nvml":
            check.stage("before_init")
        if record["status"] == "failed" and (spec.crash or is_sticky_record(record)):
            error = record["error"]
            if error["type"].endswith("StepTimeout"):  # the check's clock, not the app
                check.could_not_run = f"step '{spec.name}' did not finish: {error['message']}"
            else:
                check.fail("crash", spec.name, f"{error['type']}: {error['message'][:200]}")
    for spec in SPECS:  # the steps a stop left out, so the JSON lists every one
        check.report["steps"].setdefault(spec.name, {
            "answers": spec.answers, "status": "skipped",
            "reason": check.could_not_run or "the imports failed"})
    faulthandler.cancel_dump_traceback_later()
    untested = [name for name in PROMISE_STEPS
                if check.report["steps"][name]["status"] != "ok"
                and not (check.dry and name in CUDA_ONLY)
                and (check.steps.only is None or name in check.steps.only)]
    # A crash is the answer (exit 1), even though it stopped the promise's steps.
    if untested and not check.could_not_run and not check.report["failures"]:
        check.could_not_run = (f"the promise was not put to the test: {', '.join(untested)} "
                               "did not run to the end")
    return finish(check)


def finish(check: Check) -> int:
    """The verdict and exit code, the JSON's last write, and the one-screen summary."""
    report = check.report
    if check.import_failed or check.could_not_run:
        verdict, code = "could not run", 2
    elif report["failures"]:
        verdict, code = "failed", 1
    else:
        verdict, code = "passed", 0
    report.update(verdict=verdict, exit_code=code,
                  finished_utc=datetime.now(UTC).isoformat(timespec="seconds"),
                  elapsed_s=round(time.monotonic() - check.started, 1))
    if check.could_not_run:
        report["could_not_run"] = check.could_not_run
    check.write()
    shutil.rmtree(check.workdir, ignore_errors=True)
    print("\n".join(summary(report)))
    return code


def ask_only(check: Check, only: frozenset[str] | None) -> None:
    """Make ``check`` a rerun of the steps ``only`` (from ``selected``), recorded in its
    JSON; None: the whole check."""
    check.steps.only = only
    if only is not None:
        check.report["only"] = sorted(only, key=STEPS.index)


def main() -> int:
    # First of all: a segfault or a hang in C code (an import included) leaves a traceback.
    faulthandler.enable()
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
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
    parser.add_argument("--only", type=lambda text: text.split(","), metavar="STEP,...",
                        help="rerun these steps (and what they need) after a run that "
                        f"failed in them; the steps: {', '.join(STEPS)}")
    parser.add_argument("--prepare", type=Path, nargs="?", const=WHEEL_DIR, metavar="DIR",
                        help="download the wheels the GPU machine lacks into DIR "
                        f"(default {WHEEL_DIR.relative_to(ROOT)}) and stop")
    args = parser.parse_args()
    if args.prepare is not None:
        return prepare(args.prepare)
    try:
        only = selected(args.only) if args.only else None
    except ValueError as exc:
        parser.error(str(exc))
    dry_known = args.dry or args.device == "cpu"
    if dry_known and args.out is not None and args.out.resolve() == REAL_RUN_FILE:
        print(f"refusing: {REAL_RUN_FILE.relative_to(ROOT)} holds a real GPU run; the dry "
              "mode writes elsewhere (--out)", file=sys.stderr)
        return 2
    check = Check(args)
    ask_only(check, only)
    return run(check)


if __name__ == "__main__":
    raise SystemExit(main())
