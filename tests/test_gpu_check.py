"""bench/gpu_check.py: a GPU is lent for minutes, once, so its one run must never be lost.

The runner is tested on its own (a failing, skipped or hung step is recorded and the run
goes on, the JSON rewritten after every step), the forced OOM's limit with numbers, and
the whole check in its dry mode on the CPU, as CI runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_check import MIN_STEP, REAL_RUN_FILE, STEPS, oom_limit
from bench.gpu_check_runner import Skip, Steps, StepSpec, write_json

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
# What only a GPU can run; every other step runs on the CPU in the dry mode.
CUDA_STEPS = {"cuda_context", "snapshot_cost", "pressure_oom"}


def fingerprint(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_the_forced_oom_limit_lets_m_fit_and_not_2m():
    """The limit caps reserved segments: what is reserved after empty_cache plus the
    reserved growth of a batch of m, and half the step to 2m."""
    base = 40 * MiB  # weights rounded to segments, plus the cuBLAS workspace
    increases = {1: 20 * MiB, 2: 20 * MiB, 4: 42 * MiB, 8: 84 * MiB, 16: 166 * MiB}
    m, limit = oom_limit(base, increases)
    assert m == 2
    assert base + increases[2] < limit < base + increases[4]


def test_the_forced_oom_limit_skips_steps_smaller_than_a_segment():
    increases = {1: 0, 2: 0, 4: MIN_STEP - 1, 8: 30 * MiB, 16: 60 * MiB}
    m, limit = oom_limit(0, increases)
    assert m == 4
    assert increases[4] < limit < increases[8]
    assert oom_limit(0, {1: 0, 2: 0, 4: 0, 8: 0, 16: 0}) is None


def test_a_failing_step_is_recorded_and_the_run_goes_on(tmp_path):
    out = tmp_path / "check.json"
    report: dict = {}
    steps = Steps(report, lambda: write_json(out, report), budget_s=60)
    seen_after: dict[str, dict] = {}

    def fails(result):
        result["measured_before_failing"] = 7
        raise ValueError("boom")

    def skips(result):
        raise Skip("no such device here")

    def works(result):
        result["value"] = 1
        return "all fine"

    specs = [StepSpec("fails", "a"), StepSpec("skips", "b"), StepSpec("works", "c"),
             StepSpec("needs_failed", "d", needs=("fails",)),
             StepSpec("gpu_only", "e", cuda="a GPU")]
    for spec, fn in zip(specs, [fails, skips, works, works, works], strict=True):
        steps.run(spec, fn, dry=True)
        seen_after[spec.name] = json.loads(out.read_text())["steps"][spec.name]
    assert seen_after["fails"]["status"] == "failed"
    assert seen_after["fails"]["error"]["type"] == "ValueError"
    assert seen_after["fails"]["error"]["message"] == "boom"
    assert seen_after["fails"]["result"] == {"measured_before_failing": 7}
    assert seen_after["skips"]["status"] == "skipped"
    assert seen_after["skips"]["reason"] == "no such device here"
    assert seen_after["works"]["status"] == "ok"
    assert seen_after["works"]["summary"] == "all fine"
    assert seen_after["needs_failed"]["status"] == "skipped"
    assert "'fails'" in seen_after["needs_failed"]["reason"]
    assert "needs CUDA" in seen_after["gpu_only"]["reason"]


def test_a_hung_step_costs_its_limit_not_the_run(tmp_path):
    report: dict = {}
    steps = Steps(report, lambda: None, budget_s=60)

    def hangs(result):
        try:
            time.sleep(30)
        except Exception:  # a step's own broad handler must not swallow the timeout
            result["swallowed"] = True

    started = time.monotonic()
    record = steps.run(StepSpec("hangs", "x", limit_s=0.3), hangs)
    assert time.monotonic() - started < 5
    assert record["status"] == "failed"
    assert record["error"]["type"].endswith("StepTimeout")
    assert "swallowed" not in record["result"]


def test_a_step_that_no_longer_fits_the_budget_is_skipped_saying_so():
    steps = Steps({}, lambda: None, budget_s=0)
    record = steps.run(StepSpec("late", "x", min_s=5), lambda result: "ran")
    assert record["status"] == "skipped"
    assert record["reason"].startswith("out of time")


def test_the_dry_mode_refuses_to_write_the_real_run_file():
    before = fingerprint(REAL_RUN_FILE)
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry", "--out",
                           str(REAL_RUN_FILE)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "refusing" in done.stderr
    assert fingerprint(REAL_RUN_FILE) == before


@pytest.mark.slow
def test_the_dry_run_records_every_step_on_the_cpu(tmp_path):
    """What CI runs: every step that needs no GPU runs on the CPU, the rest are skipped
    saying why, the promise holds, and docs/gpu-check.json is left alone."""
    out = tmp_path / "check.json"
    before = fingerprint(REAL_RUN_FILE)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GPU CHECK PASSED" in done.stdout
    assert fingerprint(REAL_RUN_FILE) == before
    report = json.loads(out.read_text())
    assert report["mode"] == "dry-cpu"
    assert report["torch_version"]
    assert report["failures"] == []
    steps = report["steps"]
    assert list(steps) == list(STEPS)
    for name, record in steps.items():
        assert record["answers"], name
        if record["status"] == "skipped":
            assert record["reason"], name
        elif name != "nvml":  # NVML runs where a driver is installed, even without CUDA
            assert record["status"] == "ok", (name, record)
    for name in CUDA_STEPS:
        assert steps[name]["status"] == "skipped"
        assert "needs CUDA" in steps[name]["reason"]
    assert "does not exist yet" in steps["multi_model"]["reason"]
    ran = set(STEPS) - CUDA_STEPS - {"nvml", "multi_model"}
    assert {name for name in ran if steps[name]["status"] == "ok"} == ran
    forced = steps["forced_oom"]["result"]
    assert forced["split"]["answered"] == forced["split"]["batch"]
    assert forced["split"]["guard"]["oom_events"] >= 1
    assert forced["single"]["refused_503"] == 1
    server = steps["server_path"]["result"]
    assert server["back_to_ok"] is True
    assert server["phases"]["load"]["oom_events"] >= 1
    assert set(report["stages"]) >= {"load", "first_forward", "warmup", "after_empty_cache",
                                     "end"}
