"""bench/gpu_check in its dry mode on the CPU, as CI runs it: every step that needs no GPU
runs, the rest are skipped saying why, and the promise holds. A live test: the whole
check, the Lite models loaded and served by real engines: a subprocess of about 25 s
on this 2-core machine under load.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_check.plan import LITE, REAL_RUN_FILE, STEPS

ROOT = Path(__file__).resolve().parents[2]
# What only a GPU can run; every other step runs on the CPU in the dry mode.
CUDA_STEPS = {"cuda_context", "snapshot_cost", "pressure_oom"}


def fingerprint(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


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
    assert server["profile_reused"] is False  # measured, not warmup's profile read back
    assert server["phases"]["load"]["oom_events"] >= 1
    assert set(report["stages"]) >= {"load", "first_forward", "warmup", "after_empty_cache",
                                     "multi_model", "end"}
    check_multi_model(steps["multi_model"]["result"])
    precision = steps["precision"]["result"]
    rows = {(r["precision"], r["channels_last"]): r for r in precision["rows"]}
    assert len(rows) == 6 and rows[("fp32", False)]["largest_difference"] == 0.0
    for setting, row in rows.items():  # every setting runs on the CPU and agrees
        assert row["agrees"] and row["top1_same"][0], (setting, row)
        assert row["largest_difference"] < 0.02 and row["images_per_s"] > 0, (setting, row)
    assert precision["recommended"]["on"] == "cpu"
    own = steps["own_models"]["result"]
    for form in ("export", "onnx"):  # onnx and onnx2torch are installed here
        assert own[form]["device"] == "cpu" and own[form]["weights_bytes"] > 0, own
        assert own[form]["largest_difference"] <= 1e-5, own


def check_multi_model(multi: dict) -> None:
    """The multi-model step in the dry mode: on the CPU its memory figures are the engine
    probe's count of weights, so they match to the byte."""
    loads = {record["model"]: record for record in multi["loads"]}
    assert list(loads) == list(LITE)
    for record in loads.values():
        measured = record["measured"]
        assert record["classified"]["top1"] == "espresso"
        # The pinned model is measured whole before ready; a load on demand measures
        # batch size 1 before it answers, the rest in the background (architecture.md).
        assert measured["weights_bytes"] > 10_000_000
        assert measured["batch_size"] in ((2,) if record["pinned"] else (1, 2))
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
        # Marked, or no profile was stored that a later load could reuse.
        assert attempt["profile_marked"] or not attempt["profile_reusable"]
    room = attempts["batch_does_not_fit"]  # the weights fit, a pass of one does not
    assert room["out_of_memory_in"] == ["warm_up"]
    assert room["outcome"] == "loaded" and room["classified"]["top1"] == "espresso"
    short = attempts["weights_do_not_fit"]  # then, after Lite1 gave its weights back, the
    assert short["out_of_memory_in"] == ["load", "warm_up"]  # weights fit and a pass did not
    assert short["outcome"] == "503 insufficient_memory"
    assert short["loaded_after"] == [LITE[0]]
