"""bench/gpu_check.py: a GPU is lent for minutes, once, so its one run must never be lost.

The runner is tested on its own (a failing, skipped or hung step is recorded and the run
goes on, the JSON rewritten after every step), the forced OOM's limit, the multi-model
step's budget and rooms with numbers, its dry-mode stand-in for a full GPU, and the whole
check in its dry mode on the CPU, as CI runs it.
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
import torch

from app.engine.residency import Footprint, needed
from app.memory.fit import MemoryFit
from bench.gpu_check import (
    LITE,
    MIN_STEP,
    REAL_RUN_FILE,
    STEPS,
    ShortDevice,
    load_oom_rooms,
    oom_limit,
    two_of_three,
)
from bench.gpu_check_runner import Skip, Steps, StepSpec, write_json

ROOT = Path(__file__).resolve().parents[3]
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
    short = ShortDevice(torch, "m", room=30 * MiB, fit=MemoryFit(2 * MiB, 8 * MiB))
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
    ran = set(STEPS) - CUDA_STEPS - {"nvml"}
    assert {name for name in ran if steps[name]["status"] == "ok"} == ran
    forced = steps["forced_oom"]["result"]
    assert forced["split"]["answered"] == forced["split"]["batch"]
    assert forced["split"]["guard"]["oom_events"] >= 1
    assert forced["single"]["refused_503"] == 1
    server = steps["server_path"]["result"]
    assert server["back_to_ok"] is True
    assert server["phases"]["load"]["oom_events"] >= 1
    assert set(report["stages"]) >= {"load", "first_forward", "warmup", "after_empty_cache",
                                     "multi_model", "end"}
    check_multi_model(steps["multi_model"]["result"])


def check_multi_model(multi: dict) -> None:
    """The multi-model step in the dry mode: on the CPU its memory figures are the engine
    probe's count of weights, so they match to the byte."""
    loads = {record["model"]: record for record in multi["loads"]}
    assert list(loads) == list(LITE)
    for record in loads.values():
        measured = record["measured"]
        assert record["classified"]["top1"] == "espresso"
        assert measured["weights_bytes"] > 10_000_000 and measured["batch_size"] == 2
        assert measured["profile_reused"] is False  # first loads: measured
        assert record["memory_delta"]["allocated"] == measured["weights_bytes"]
        # Before the first load the engine knows only the weights file's size.
        assert record["predicted"]["weights_bytes"] >= measured["weights_bytes"]
    assert [loads[name]["pinned"] for name in LITE] == [True, False, False]
    assert multi["admin_unload"]["gave_back_its_weights"] is True

    eviction = multi["eviction"]
    pair_1, pair_2, three = eviction["needed_bytes"].values()
    assert max(pair_1, pair_2) < eviction["memory_budget"] < three
    requests = eviction["requests"]
    assert [r["request"] for r in requests] == [LITE[1], LITE[2], LITE[1]]
    assert [r["evicted"] for r in requests] == [[], [LITE[1]], [LITE[2]]]
    # At the third request the pinned Lite0 is the least recently used, and stays.
    assert requests[2]["least_recently_used_first"][0] == LITE[0]
    assert all(LITE[0] in r["loaded_after"] and r["classified"]["espresso"] for r in requests)
    assert all(u["gave_back_its_weights"] for r in requests for u in r["unloads"])
    assert eviction["unloads_by_model"] == {LITE[0]: {}, LITE[1]: {"evicted": 1},
                                            LITE[2]: {"evicted": 1}}

    oom = multi["oom_on_load"]
    assert oom["method"].startswith("stand-in")
    attempts = {attempt["kind"]: attempt for attempt in oom["attempts"]}
    for attempt in attempts.values():
        assert attempt["evicted"] == [LITE[1]]  # one more eviction, then the retry
        assert attempt["leak_bytes"] == 0 and attempt["half_loaded_alive"] == []
        assert attempt["profile_marked"] is True
    room = attempts["batch_does_not_fit"]  # the weights fit, a pass of one does not
    assert room["out_of_memory_in"] == ["warm_up"]
    assert room["outcome"] == "loaded" and room["classified"]["top1"] == "espresso"
    short = attempts["weights_do_not_fit"]  # then, after Lite1 gave its weights back, the
    assert short["out_of_memory_in"] == ["load", "warm_up"]  # weights fit and a pass did not
    assert short["outcome"] == "503 insufficient_memory"
    assert short["loaded_after"] == [LITE[0]]
