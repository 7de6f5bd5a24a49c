"""bench/gpu_check: a GPU is lent for minutes, once, so its one run must never be lost.

The runner is tested on its own (a failing, skipped or hung step is recorded and the run
goes on, the JSON rewritten after every step), the forced OOM's limit, the multi-model
step's budget and rooms with numbers, and its dry-mode stand-in for a full GPU. The whole
check in its dry mode on the CPU, as CI runs it, is tests/live/test_gpu_check_live.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from app.engine.residency import Footprint, needed
from app.memory.fit import MemoryFit
from bench.gpu_check.load_oom import load_oom_rooms
from bench.gpu_check.memory import in_fresh_thread
from bench.gpu_check.model_watch import ShortDevice
from bench.gpu_check.models import two_of_three
from bench.gpu_check.oom import oom_limit
from bench.gpu_check.plan import MIN_STEP, PROMISE_STEPS, REAL_RUN_FILE, STEPS, selected
from bench.gpu_check.runner import Skip, Steps, StepSpec, write_json

ROOT = Path(__file__).resolve().parents[3]
MiB = 1024**2


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


def test_a_budget_for_two_of_three_models_holds_either_pair_but_not_all_three():
    """Lite0's, Lite1's and Lite2's footprints on a 2-core CPU at batch 2 (weights, peak)."""
    lite0, lite1, lite2 = (Footprint(18 * MiB, 24 * MiB), Footprint(21 * MiB, 27 * MiB),
                           Footprint(23 * MiB, 32 * MiB))
    budget = two_of_three({"lite0": lite0, "lite1": lite1, "lite2": lite2})
    assert needed([lite0, lite1]) < budget and needed([lite0, lite2]) < budget
    assert needed([lite0, lite1, lite2]) > budget
    with pytest.raises(ValueError):  # no weights: three fit wherever two do
        two_of_three({"a": Footprint(0, MiB), "b": Footprint(0, MiB), "c": Footprint(0, MiB)})


def test_the_out_of_memory_on_load_rooms_fit_the_weights_and_not_one_image_then_not_them():
    weights, one_image = 23 * MiB, 16 * MiB
    rooms = load_oom_rooms(weights, one_image)
    assert weights < rooms["batch_does_not_fit"] < weights + one_image
    assert rooms["weights_do_not_fit"] < weights


def test_the_dry_modes_stand_in_for_a_full_gpu_raises_where_the_gpu_would():
    """ShortDevice: the weights copy and each forward pass raise CUDA's out-of-memory when
    they would not fit in the room, plus what unloaded models gave back."""
    short = ShortDevice("m", room=30 * MiB, fit=MemoryFit(2 * MiB, 8 * MiB))
    short.copy_weights(20 * MiB)
    hook = short.forward_hook(20 * MiB)
    hook(None, (torch.zeros(1, 3, 2, 2),))  # 20 + 2 + 8 = 30 MiB: fits
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        hook(None, (torch.zeros(2, 3, 2, 2),))
    with pytest.raises(torch.OutOfMemoryError):
        short.copy_weights(31 * MiB)
    short.gave_back(8 * MiB)  # another model was unloaded
    hook(None, (torch.zeros(2, 3, 2, 2),))
    short.active = False  # the filler is gone
    short.copy_weights(10**12)
    assert short.raised == ["a forward pass of 2", "copying the weights"]


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


def test_the_promise_steps_run_right_after_warmup():
    """On a cold machine an overrun lands on the diagnostics, not on the promise."""
    after_warmup = STEPS[STEPS.index("warmup") + 1:][:len(PROMISE_STEPS)]
    assert after_warmup == PROMISE_STEPS


def test_a_rerun_of_some_steps_brings_what_they_need_and_nothing_else():
    assert selected(["pressure_oom"]) == {"imports", "versions", "cuda_context", "final",
                                          "load", "warmup", "pressure_oom"}
    assert selected(["empty_cache", "own_models"]) >= {"warmup", "load", "own_models"}
    assert "multi_model" not in selected(["forced_oom"])
    with pytest.raises(ValueError, match="no such step: pressure"):
        selected(["pressure"])


def test_a_step_left_out_of_a_rerun_is_skipped_saying_so():
    steps = Steps({}, lambda: None, budget_s=60)
    steps.only = frozenset({"a"})
    assert steps.run(StepSpec("a", "x"), lambda result: "ran")["status"] == "ok"
    record = steps.run(StepSpec("b", "y"), lambda result: "ran")
    assert record["status"] == "skipped" and "--only" in record["reason"]


def check_run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry", "--out",
                           str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    return done.returncode, json.loads(out.read_text()) if out.exists() else {}


def test_a_crash_at_the_start_exits_1_as_documented(tmp_path):
    """The load crashes (an unknown model): the run failed (1), though the promise's steps
    could not run after it; not 'could not give an answer' (2)."""
    code, report = check_run(tmp_path, "--model", "no_such_model")
    assert (code, report["verdict"]) == (1, "failed")
    assert report["failures"][0]["step"] == "load" and "could_not_run" not in report
    assert report["steps"]["forced_oom"]["status"] == "skipped"


def test_only_an_unknown_step_is_refused_with_the_list():
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry", "--only",
                           "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such step: nope" in done.stderr


def test_a_sweep_runs_in_a_thread_of_its_own_and_its_error_comes_back():
    """cuDNN's plan cache is per thread: the benchmark sweeps must not run in this one."""
    threads: list[str] = []
    in_fresh_thread(lambda: threads.append(threading.current_thread().name))
    assert threads == ["gpu-check-sweep"]

    def fails() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        in_fresh_thread(fails)
