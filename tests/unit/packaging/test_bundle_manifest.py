"""packaging/build.py's checks on a folder shaped like a bundle (no PyInstaller run), the
files loading an own model needs, and the Windows manifest, part size and path length
held to the real Windows torch wheels (their file list in tests/data/windows-cpu-wheels.json,
made by packaging/wheel_files.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

import yaml
from live_server import ROOT

from installer.build_installer import DEFAULT_PART_BYTES

WHEELS = json.loads((ROOT / "tests" / "data" / "windows-cpu-wheels.json").read_text())
MANIFEST = tomllib.loads((ROOT / "packaging" / "manifest.toml").read_text())
WINDOWS = MANIFEST["windows"]
# What loading an own model needs as files (docs/own-models.md): safetensors' and onnx's
# compiled halves, and the transformers sources its lazy modules read at run time.
TRANSFORMERS_SOURCES = ["_internal/transformers/models/auto/modeling_auto.py",
                        "_internal/transformers/models/resnet/modeling_resnet.py"]
OWN_MODELS = {
    "linux": ["_internal/safetensors/_safetensors_rust*.so",
              "_internal/onnx/onnx_cpp2py_export*.so", *TRANSFORMERS_SOURCES],
    "windows": ["_internal/safetensors/_safetensors_rust*.pyd",
                "_internal/onnx/onnx_cpp2py_export*.pyd", *TRANSFORMERS_SOURCES],
}


def load_build():
    """packaging/build.py as a module (the name "packaging" belongs to PyPA's library)."""
    spec = importlib.util.spec_from_file_location("vramguard_build",
                                                  ROOT / "packaging" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What a fake bundle's programs carry: the app, and names that merely begin like ones
# manifest.toml's [never] lists (which must not count as those).
MODULES = ["app", "app.http.server", "app.clustering", "tray", "rayleigh", "redistribute"]


def program(path: Path, modules: list[str]) -> None:
    """An executable as PyInstaller lays it out: an archive that holds the module archive
    (PYZ), here with ``modules`` as entries without code."""
    from PyInstaller.archive.writers import CArchiveWriter, ZlibArchiveWriter

    pyz = path.with_name(path.name + ".pyz")
    ZlibArchiveWriter(str(pyz), [(module, "-", "PYMODULE") for module in modules])
    CArchiveWriter(str(path), [("PYZ.pyz", str(pyz), False, "z")], "libpython3.11.so")
    pyz.unlink()


def fake_bundle(dist: Path, platform: str, modules: list[str] = MODULES) -> Path:
    """A file for every manifest entry of this platform (globs made concrete); on Linux its
    two programs carry ``modules``."""
    manifest = tomllib.loads((ROOT / "packaging" / "manifest.toml").read_text())[platform]
    bundle = dist / "vramguard"
    for entry in manifest["core"] + manifest["cuda"]:
        path = bundle / entry.replace("*", "x")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 1000)
    if platform == "linux":
        for name in ("vramguard", "vramguard-desktop"):
            program(bundle / name, modules)
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


def test_the_manifest_requires_what_loading_an_own_model_needs():
    for platform, entries in OWN_MODELS.items():
        assert [entry for entry in entries if entry not in MANIFEST[platform]["core"]] == []


def test_the_own_model_entries_name_files_the_installed_packages_have():
    """The Linux entries, held to this Python's safetensors, onnx and transformers (the
    Windows ones name the win_amd64 wheels' .pyd files, as manifest.toml says)."""
    import torch

    site = Path(torch.__file__).parent.parent
    assert [entry for entry in OWN_MODELS["linux"]
            if not list(site.glob(entry.removeprefix("_internal/")))] == []


def test_a_bundle_without_what_own_models_need_fails_the_build(tmp_path):
    bundle = fake_bundle(tmp_path, "linux")
    for entry in OWN_MODELS["linux"]:
        for path in bundle.glob(entry):
            path.unlink()
    done = verify(tmp_path)
    assert done.returncode == 1
    assert [entry for entry in OWN_MODELS["linux"] if f"missing: {entry}" not in done.stderr
            ] == []


def test_cpu_only_builds_skip_the_cuda_libraries(tmp_path):
    bundle = fake_bundle(tmp_path, "linux")
    for library in [*bundle.glob("_internal/nvidia/*/lib/*"),
                    *bundle.glob("_internal/torch/lib/*cuda*")]:
        library.unlink()
    assert verify(tmp_path).returncode == 1
    assert verify(tmp_path, "--cpu-only").returncode == 0


def test_a_cpu_only_bundle_that_carries_cuda_libraries_fails_the_build(tmp_path):
    """What a -Cpu build in a venv left with CUDA torch made: 3 GB nobody uses."""
    fake_bundle(tmp_path, "linux")
    done = verify(tmp_path, "--cpu-only")
    assert done.returncode == 1
    assert "CUDA library in a CPU-only bundle: _internal/torch/lib/libtorch_cuda.so" in (
        done.stderr)


def test_a_bundle_that_carries_the_cluster_extra_fails_the_build(tmp_path):
    """Pure Python (redis, app.cluster) is found in the programs' module archive; extension
    modules and data (uvloop, the Lua script) as files."""
    bundle = fake_bundle(tmp_path, "linux", [*MODULES, "ray", "ray.serve", "redis.asyncio",
                                             "app.cluster.serve_app"])
    for name in ("_internal/uvloop/loop.so", "_internal/app/cluster/token_bucket.lua"):
        (bundle / name).parent.mkdir(parents=True)
        (bundle / name).write_bytes(b"\0")
    done = verify(tmp_path)
    assert done.returncode == 1
    assert ("the cluster extra in the appliance's bundle: app.cluster, ray, redis, uvloop "
            "(manifest.toml's [never]" in done.stderr)


def test_programs_that_are_not_pyinstaller_archives_fail_the_build(tmp_path):
    """A program whose modules cannot be listed cannot be shown to lack the cluster extra."""
    bundle = fake_bundle(tmp_path, "linux")
    (bundle / "vramguard-desktop").write_bytes(b"\0" * 1000)
    done = verify(tmp_path)
    assert done.returncode == 1
    assert "not a PyInstaller program: vramguard-desktop" in done.stderr


def test_a_path_too_long_for_windows_fails_the_build(tmp_path):
    bundle = fake_bundle(tmp_path, "linux")
    deep = bundle / "_internal" / "torch" / ("d" * 90) / ("f" * 90 + ".py")
    deep.parent.mkdir(parents=True)
    deep.write_text("")
    done = verify(tmp_path)
    assert done.returncode == 1
    assert "path too long for Windows" in done.stderr and "f" * 90 in done.stderr


def build_with(folder: Path, version: str, cuda: str | None,
               *extra: str) -> subprocess.CompletedProcess[str]:
    """build.py where `import torch` finds this flavour, and PyInstaller only says it ran
    (the real one would build for minutes)."""
    site = folder / "site"
    for package, files in {"torch": {"__init__.py": f"from . import version\n"
                                                    f"__version__ = {version!r}\n",
                                     "version.py": f"cuda = {cuda!r}\n"},
                           "PyInstaller": {"__init__.py": "",
                                           "__main__.py": "print('PyInstaller ran')\n"
                                                          "raise SystemExit(3)\n"}}.items():
        (site / package).mkdir(parents=True)
        for name, text in files.items():
            (site / package / name).write_text(text)
    return subprocess.run([sys.executable, "packaging/build.py", "--dist", str(folder / "d"),
                           "--work", str(folder / "w"), *extra], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
                          text=True, timeout=120)


def test_a_gpu_build_with_cpu_torch_stops_before_pyinstaller(tmp_path):
    done = build_with(tmp_path, "2.14.1+cpu", None)
    assert done.returncode == 1 and "PyInstaller ran" not in done.stdout
    assert "torch 2.14.1+cpu, which cannot use the GPU" in done.stderr
    assert "--cpu-only" in done.stderr


def test_a_cpu_only_build_with_cuda_torch_stops_before_pyinstaller(tmp_path):
    done = build_with(tmp_path, "2.14.1+cu130", "13.0", "--cpu-only")
    assert done.returncode == 1 and "PyInstaller ran" not in done.stdout
    assert "torch 2.14.1+cu130, built for CUDA 13.0" in done.stderr


def test_a_build_whose_torch_matches_goes_on_to_pyinstaller(tmp_path):
    assert "PyInstaller ran" in build_with(tmp_path / "cpu", "2.14.1+cpu", None,
                                           "--cpu-only").stdout
    assert "PyInstaller ran" in build_with(tmp_path / "gpu", "2.14.1+cu130", "13.0").stdout


def pinned_versions() -> dict[str, str]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"]
    return dict(match.groups() for dependency in dependencies
                if (match := re.fullmatch(r"(torch|torchvision)==([\d.]+)", dependency)))


def in_wheels(entry: str) -> list[str]:
    """The wheels' native files a manifest entry finds once bundled under _internal/ (a
    glob's * stays inside one folder, as in build.py)."""
    depth = len(PurePosixPath(entry).parts)
    bundled = [PurePosixPath("_internal", path) for path in WHEELS["native"]]
    return [str(path) for path in bundled if len(path.parts) == depth and path.match(entry)]


def test_the_wheel_list_is_of_the_pinned_windows_wheels():
    pins = pinned_versions()
    assert [wheel["name"] for wheel in WHEELS["wheels"]] == [
        f"{name}-{pins[name]}-cp311-cp311-win_amd64.whl" for name in ("torch", "torchvision")]


def test_the_windows_manifest_names_files_the_real_cpu_wheels_have():
    from_wheels = [entry for entry in WINDOWS["core"]
                   if entry.startswith(("_internal/torch/", "_internal/torchvision/"))]
    assert len(from_wheels) >= 3
    assert [entry for entry in from_wheels if not in_wheels(entry)] == []
    # The name the stock torchvision hook still asks for is not in the wheel.
    assert in_wheels("_internal/torchvision/_C.pyd") == []
    # A CPU-only bundle that holds a CUDA entry fails the build: no CPU file may match one.
    assert [entry for entry in WINDOWS["cuda"] if in_wheels(entry)] == []


def workflow_part_bytes() -> int:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "windows.yml").read_text())
    commands = "\n".join(step.get("run", "") for step in workflow["jobs"]["build"]["steps"])
    found = re.search(r"build\.ps1 .*-PartSizeMB (\d+)", commands)
    assert found, "the workflow builds with the default part size: one part, no multi-part"
    return int(found.group(1)) * 1024**2


def test_the_largest_windows_file_fits_a_part_and_the_workflow_makes_several():
    largest = max(WHEELS["largest"].values())
    part = workflow_part_bytes()
    assert largest < part < DEFAULT_PART_BYTES
    # torch's DLLs alone (always bundled) exceed one workflow part: the setup gets parts.
    libraries = sum(size for path, size in WHEELS["native"].items()
                    if path.endswith((".dll", ".pyd")))
    assert libraries > part


def test_the_longest_windows_path_fits_under_the_per_user_install_folder():
    build = load_build()
    longest = max(WHEELS["longest"], key=len)
    installed = build.installed_path(PurePosixPath("_internal", longest))
    assert installed.startswith("C:\\Users\\")
    assert "\\AppData\\Local\\Programs\\vramguard\\_internal\\torch" in installed
    assert len(installed) <= build.MAX_PATH
