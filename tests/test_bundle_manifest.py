"""packaging/build.py's checks on a folder shaped like a bundle (no PyInstaller run)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from live_server import ROOT


def fake_bundle(dist: Path, platform: str) -> Path:
    """A file for every manifest entry of this platform (globs made concrete)."""
    manifest = tomllib.loads((ROOT / "packaging" / "manifest.toml").read_text())[platform]
    bundle = dist / "vramguard"
    for entry in manifest["core"] + manifest["cuda"]:
        path = bundle / entry.replace("*", "x")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 1000)
    return bundle


def verify(dist: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "packaging/build.py", "--dist", str(dist),
                           "--verify-only", *extra], cwd=ROOT, capture_output=True, text=True)


def test_a_complete_bundle_passes_and_is_sized_by_component(tmp_path):
    fake_bundle(tmp_path, "linux")
    done = verify(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "manifest: all required files present" in done.stdout
    assert "nvidia/cu13" in done.stdout and "torch/lib" in done.stdout


def test_a_bundle_without_torchvision_ops_or_nvrtc_builtins_fails_the_build(tmp_path):
    bundle = fake_bundle(tmp_path, "linux")
    (bundle / "_internal" / "torchvision" / "_C_stable.so").unlink()
    for builtins in bundle.glob("_internal/nvidia/cu13/lib/libnvrtc-builtins*"):
        builtins.unlink()
    done = verify(tmp_path)
    assert done.returncode == 1
    assert "missing: _internal/torchvision/_C_stable.so" in done.stderr
    assert "missing: _internal/nvidia/cu13/lib/libnvrtc-builtins.so.*" in done.stderr


def test_cpu_only_builds_skip_the_cuda_libraries(tmp_path):
    bundle = fake_bundle(tmp_path, "linux")
    for library in bundle.glob("_internal/nvidia/*/lib/*"):
        library.unlink()
    assert verify(tmp_path).returncode == 1
    assert verify(tmp_path, "--cpu-only").returncode == 0
