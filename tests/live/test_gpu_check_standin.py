"""The whole GPU check down its CUDA branches, before a GPU ever runs it: ``torch.cuda`` and
NVML are the stand-ins, tensors placed on "cuda" live on the CPU and are counted by the
stand-in's caching allocator (tests/support/gpu_check_on_standin.py). Every step, the four
that put the promise to the test included, must run to the end: an error there would
otherwise be found on the lent GPU, at exit 2. A live test: a subprocess of about 45 s on
this 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.gpu_check.plan import LITE, PROMISE_STEPS, STEPS, selected

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "support" / "gpu_check_on_standin.py"


def check_on_standin(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(RUNNER), str(out), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_the_whole_check_runs_its_cuda_branches_on_the_standin(tmp_path):
    out = tmp_path / "check.json"
    done = check_on_standin(out)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "GPU CHECK PASSED" in done.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "cuda" and report["failures"] == []
    steps = report["steps"]
    assert list(steps) == list(STEPS)
    for name, record in steps.items():  # nothing skipped: every branch ran
        assert record["status"] == "ok", (name, record)
    context = steps["cuda_context"]["result"]
    assert context["per_process"]["matched"] is True  # NVML lists this PID
    forced = steps["forced_oom"]["result"]
    assert forced["split"]["answered"] == forced["split"]["batch"]
    assert forced["split"]["guard"]["oom_events"] >= 1
    assert "torch.OutOfMemoryError" in forced["split"]["exceptions_seen"]
    assert forced["leak_bytes"] == 0
    server = steps["server_path"]["result"]
    assert server["back_to_ok"] is True and server["profile_reused"] is False
    pressure = steps["pressure_oom"]["result"]
    assert pressure["split"]["answered"] == pressure["split"]["batch"]
    assert pressure["room"]["filler_bytes"] > 0
    multi = steps["multi_model"]["result"]
    assert [record["model"] for record in multi["loads"]] == list(LITE)
    for record in multi["loads"]:  # on "cuda": the allocator's figures, not the probe's
        assert record["classified"]["top1"] == "espresso"
        assert record["measured"]["weights_bytes"] > 10_000_000
    attempts = {a["kind"]: a for a in multi["oom_on_load"]["attempts"]}
    assert attempts["weights_do_not_fit"]["outcome"] == "503 insufficient_memory"
    assert all(a["half_loaded_alive_after_gc"] == [] for a in attempts.values())
    assert multi["admin_unload"]["gave_back_its_weights"] is True
    assert set(PROMISE_STEPS) <= set(steps)
    assert steps["precision"]["result"]["recommended"]["on"] != "cpu"
    assert set(report["stages"]) >= {"before_init", "load", "warmup", "end"}


def test_a_rerun_with_only_runs_what_was_asked_and_what_it_needs(tmp_path):
    """The rerun after a failed promise step, as docs/memory.md gives it, down the CUDA
    branches: those steps and what they need run, the rest is recorded as skipped."""
    out = tmp_path / "rerun.json"
    asked = ["pressure_oom", "multi_model"]
    done = check_on_standin(out, "--only", ",".join(asked))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["only"] == sorted(selected(asked), key=STEPS.index)
    steps = report["steps"]
    assert list(steps) == list(STEPS)
    for name, record in steps.items():
        if name in selected(asked):
            assert record["status"] == "ok", (name, record)
        else:
            assert record["status"] == "skipped", (name, record)
            assert "not asked for" in record["reason"]
    assert {"load", "warmup"} <= set(report["only"]) and "forced_oom" not in report["only"]
    assert steps["multi_model"]["result"]["admin_unload"]["gave_back_its_weights"] is True
