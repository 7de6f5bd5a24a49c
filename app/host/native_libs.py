"""Which native libraries torch needs here, and whether each one loads.

"DLL load failed" is the classic way a bundled PyTorch dies. `vramguard doctor` lists
the CUDA libraries that came with torch (in torch's lib folder on Windows, in the
`nvidia` packages on Linux), loads each one, and checks what must come from the
computer itself: the NVIDIA driver and, on Windows, the Visual C++ runtime.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

# The CUDA libraries vramguard's inference path uses (runtime, BLAS, cuDNN, NVRTC).
CUDA_LIBRARY_PATTERNS = ("*cudart*", "*cublas*", "*cudnn*", "*nvrtc*", "*nvJitLink*",
                         "*cufft*", "*curand*", "*cusparse*", "*cusolver*")
LIBRARY_SUFFIXES = (".dll", ".so")
DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
# Bundled libraries linked against the driver itself: without a driver they cannot load,
# and that is normal on a computer without an NVIDIA GPU. (Windows' loader error does not
# name the missing DLL, so they are known by name.)
DRIVER_LINKED = ("caffe2_nvrtc",)
VC_RUNTIME = ("vcruntime140.dll", "vcruntime140_1.dll", "msvcp140.dll")


@dataclass(frozen=True)
class LibraryCheck:
    name: str
    path: str
    error: str | None  # None: loaded

    @property
    def ok(self) -> bool:
        return self.error is None

    def needs_driver(self) -> bool:
        """Whether the failure is only the NVIDIA driver's absence."""
        return self.error is not None and (DRIVER_LIBRARY in self.error or any(
            marker in self.name for marker in DRIVER_LINKED))


def _is_library(path: Path) -> bool:
    return path.suffix in LIBRARY_SUFFIXES or ".so." in path.name


def _site() -> Path | None:
    """The folder holding torch, found without importing it (the import is what fails)."""
    if getattr(sys, "frozen", False):
        return Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent))
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def library_dirs() -> list[Path]:
    """Where torch keeps the CUDA libraries, frozen or not (torch/lib, nvidia/*/lib)."""
    site = _site()
    if site is None:
        return []
    folders = [site / "torch" / "lib", *sorted(site.glob("nvidia/*/lib")),
               *sorted(site.glob("nvidia/*/bin"))]
    return [folder for folder in folders if folder.is_dir()]


def cuda_libraries(folders: list[Path]) -> list[Path]:
    """Every CUDA library file in these folders, once each, in a stable order."""
    found: dict[str, Path] = {}
    for folder in folders:
        for pattern in CUDA_LIBRARY_PATTERNS:
            for path in folder.glob(pattern):
                if path.is_file() and _is_library(path):
                    found.setdefault(path.name, path)
    return [found[name] for name in sorted(found)]


def _load(target: str) -> str | None:
    try:
        ctypes.CDLL(target)
    except OSError as exc:
        # A frozen app's ctypes says only "not found when the application was frozen";
        # the loader's own reason (e.g. which dependency is missing) is the cause.
        return str(exc.__cause__ or exc)
    return None


def check_cuda_libraries(folders: list[Path]) -> list[LibraryCheck]:
    """Load each CUDA library in `folders` (from library_dirs()); a failure says why."""
    return [LibraryCheck(path.name, str(path), _load(str(path)))
            for path in cuda_libraries(folders)]


def check_driver() -> LibraryCheck:
    """The NVIDIA driver's CUDA library comes with the driver, never with vramguard."""
    return LibraryCheck(DRIVER_LIBRARY, DRIVER_LIBRARY, _load(DRIVER_LIBRARY))


def check_vc_runtime() -> list[LibraryCheck]:
    """Windows only: torch's DLLs need the Visual C++ 2015-2022 runtime."""
    if sys.platform != "win32":
        return []
    return [LibraryCheck(name, name, _load(name)) for name in VC_RUNTIME]
