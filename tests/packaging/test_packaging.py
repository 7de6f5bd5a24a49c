"""The real bundle, built from the spec, checked and smoke-tested; then its installer,
compiled in parts, installed and uninstalled under wine (the Linux twin of the
Windows build: the same spec, build.py, installer script and checks).

Slow (about 10 minutes on 2 cores) and big (at most about 11 GB of temporary disk at
once: the last test frees the bundle once the installer holds it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import ROOT
from PyInstaller.archive.readers import pkg_archive_contents
from wine import RUN_KEY, UNINSTALL_KEY, WinePrefix, tools_missing, verify_checksums

VERSION = __import__("app").__version__
NSIS_LIMIT = 2 * 1024**3
BUILD_NICENESS = 4  # 10 starved the build behind other programs' work (1,800 s)


def run(*command: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Iterator[Path]:
    """The built bundle; deleted afterwards, pass or fail (pytest keeps temporary folders
    of recent runs, and this one holds 4 GB)."""
    folder = tmp_path_factory.mktemp("dist")
    work = folder.parent / "pyinstaller-work"
    # This lane builds beside the one that starts servers (tests/conftest.py): it yields
    # them part of the CPU, whose deadlines are set for a machine of their own, without
    # falling behind every other program on a busy machine. Everything it
    # starts from here on (PyInstaller, makensis, wine) inherits the priority.
    os.nice(BUILD_NICENESS)
    try:
        built = run("packaging/build.py", "--dist", str(folder), "--work", str(work))
        assert built.returncode == 0, built.stdout + built.stderr[-5000:]
        assert "manifest: all required files present" in built.stdout
        yield folder
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(folder / "vramguard", ignore_errors=True)


def test_the_bundle_has_what_the_stock_hooks_miss_and_not_what_inference_skips(dist):
    bundle = dist / "vramguard"
    report = json.loads((dist / "bundle-report.json").read_text())
    assert report["total_bytes"] > 1024**3 and report["files"] > 1000
    assert (bundle / "_internal" / "torchvision" / "_C_stable.so").is_file()
    assert list(bundle.glob("_internal/nvidia/*/lib/libnvrtc-builtins.so.*"))
    assert not (bundle / "_internal" / "triton").exists()
    assert not (bundle / "_internal" / "scipy").exists()
    # Nor the cluster extra, even where the build environment has it installed.
    never = tomllib.loads((ROOT / "packaging" / "manifest.toml").read_text())["never"]["modules"]
    modules = set(pkg_archive_contents(str(bundle / "vramguard")))
    assert "app.http.server" in modules  # the app's own modules are where this looks
    assert not {m for m in modules for name in never if m == name or m.startswith(name + ".")}
    assert not [name for name in never if (bundle / "_internal" / Path(*name.split("."))).exists()]


def test_smoke_passes_on_the_bundle(dist):
    done = run("packaging/smoke.py", "--bundle", str(dist / "vramguard"), "--json",
               str(dist / "smoke.json"), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((dist / "smoke.json").read_text())
    assert result["label"] == "espresso" and result["peak_rss_bytes"] > 0
    # An own model of each loader was added (or copied in), listed and served.
    assert set(result["own_models"]) == {"smoke-timm", "smoke-onnx", "smoke-transformers"}
    assert any("CUDA libraries" in line and "bundled" in line for line in result["doctor"])


@pytest.fixture
def scratch(tmp_path) -> Iterator[Path]:
    """A temporary folder emptied afterwards, pass or fail (installer and wine prefix: 10 GB)."""
    try:
        yield tmp_path
    finally:
        for child in tmp_path.iterdir():
            shutil.rmtree(child, ignore_errors=True)


@pytest.mark.skipif(tools_missing() is not None, reason=str(tools_missing()))
def test_the_installer_carries_the_real_bundle_in_parts_under_nsis_limit(dist, scratch):
    out = scratch / "installer"
    done = run("installer/build_installer.py", "--bundle", str(dist / "vramguard"), "--out",
               str(out), "--compressor", "none")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "installer-report.json").read_text())
    assert len(report["installers"]) >= 3
    assert all(size < NSIS_LIMIT for size in report["installers"].values())
    # The installer is self-contained now: free the bundle's 4 GB for the install.
    shutil.rmtree(dist / "vramguard")

    wine = WinePrefix(scratch / "prefix")
    assert wine.run(out / f"vramguard-{VERSION}-setup.exe", "/S") == 0
    for installer in [*out.glob("*.exe"), *out.glob("*.bin")]:
        installer.unlink()
    installed = verify_checksums(wine.install_dir, out / f"vramguard-{VERSION}-files.sha256")
    assert installed == report["files"]
    assert wine.shortcut.is_file()
    entry = wine.registry(UNINSTALL_KEY)
    assert entry is not None and entry["DisplayVersion"] == VERSION
    assert "vramguard" not in (wine.registry(RUN_KEY) or {})

    # The installed copy runs (Windows has no execute bit; the Linux twin needs one, and
    # its symbolic links arrive as copies: NSIS has none, and Windows bundles use none).
    for name in ("vramguard", "vramguard-desktop"):
        (wine.install_dir / name).chmod(0o755)
    smoke = run("packaging/smoke.py", "--bundle", str(wine.install_dir), timeout=900)
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr

    assert wine.run(wine.install_dir / "uninstall.exe", "/S", "/REMOVEDATA") == 0
    assert not wine.install_dir.exists()
    assert not wine.shortcut.exists() and wine.registry(UNINSTALL_KEY) is None
