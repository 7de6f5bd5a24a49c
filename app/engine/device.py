"""Pick the torch device from the `device` setting."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch

log = logging.getLogger("vramguard.device")


class DeviceError(Exception):
    """The requested device does not exist on this computer."""


def _version(arch: str) -> tuple[int, int] | None:
    """``sm_86`` or ``compute_90a`` -> (8, 6) or (9, 0); None for a name not like that."""
    match = re.fullmatch(r"(?:sm|compute)_(\d+)(\d)[a-z]?", arch)
    return (int(match.group(1)), int(match.group(2))) if match else None


def unsupported_gpu(index: int) -> str | None:
    """Why this torch build cannot run on GPU ``index`` (None when it can, or when the
    build does not say what it covers). CUDA 13 wheels carry kernels for Turing (7.5) and
    newer and no PTX: an older GPU is found and named, then fails at its first
    computation with "no kernel image is available"."""
    arches = [(arch, _version(arch)) for arch in torch.cuda.get_arch_list()]
    if not arches:
        return None
    major, minor = torch.cuda.get_device_capability(index)
    for arch, version in arches:
        if version is None:
            continue
        if arch.startswith("sm_") and version[0] == major and version[1] <= minor:
            return None  # a binary runs on its own and later minor versions
        if arch.startswith("compute_") and version <= (major, minor):
            return None  # PTX is compiled for newer GPUs when loaded
    oldest = min((v for _, v in arches if v is not None), default=None)
    covered = f"compute capability {oldest[0]}.{oldest[1]} and newer" if oldest else \
        ", ".join(arch for arch, _ in arches)
    return (f"the GPU {torch.cuda.get_device_name(index)} (compute capability "
            f"{major}.{minor}) is too old for this build of vramguard, which supports "
            f"NVIDIA GPUs with {covered}")


def nvml_driver_version() -> str | None:
    """The NVIDIA driver's version as NVML reads it; None without a driver."""
    from app.memory.nvml import Nvml

    nvml = Nvml.open()
    return nvml.driver_version() if nvml else None


def cpu_fallback_reason(setting: str,
                        driver_version: Callable[[], str | None] = nvml_driver_version
                        ) -> str | None:
    """Why `auto` runs on the CPU although an NVIDIA GPU is there (None otherwise): shown
    by the tray and the dashboard, so a user with an old card, or an old driver (CUDA
    then says only that no GPU is available), knows it was not forgotten."""
    if setting != "auto":
        return None
    if torch.cuda.is_available():
        return unsupported_gpu(0)
    version = driver_version()  # a driver is there, too old for this CUDA: say so
    if version is None:
        return None
    needed = needed_driver(torch.version.cuda)
    try:
        found = int(version.split(".")[0])
    except ValueError:
        return None
    if needed is None or found >= needed:
        return None
    return (f"the NVIDIA driver {version} is too old for this build of vramguard, which "
            f"needs {needed} or newer (CUDA {torch.version.cuda}); update it from "
            "https://www.nvidia.com/drivers and start vramguard again")


def resolve_device(setting: str) -> torch.device:
    """`auto` takes the first NVIDIA GPU when there is one this build can use, and the
    CPU otherwise (saying why in the log)."""
    if setting == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        problem = unsupported_gpu(0)
        if problem:
            log.warning("Using the CPU instead of the GPU: %s.", problem)
            return torch.device("cpu")
        return torch.device("cuda:0")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("device is set to a GPU, but no NVIDIA GPU with a working "
                              "driver was found. Use --device cpu, or install the NVIDIA "
                              "driver (run `vramguard doctor` for details).")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"GPU {index} does not exist: this computer has "
                              f"{torch.cuda.device_count()} NVIDIA GPU(s).")
        problem = unsupported_gpu(index)
        if problem:
            raise DeviceError(f"device is set to a GPU, but {problem}. Use --device cpu "
                              "(or auto, which falls back to the CPU by itself).")
        device = torch.device("cuda", index)
    return device


MIN_DRIVER = {12: 525, 13: 580}  # CUDA major version: the oldest NVIDIA driver that runs it
SYSMEM_FALLBACK_ADVICE = (
    "under WDDM the driver may move GPU memory into system memory when the GPU is full, "
    "which turns an out-of-memory error into a slowdown of 10 times or more; vramguard "
    "keeps within the GPU's memory itself, so turn that off: NVIDIA Control Panel > "
    "Manage 3D settings > CUDA - Sysmem Fallback Policy > Prefer No Sysmem Fallback")


def needed_driver(cuda_version: str | None) -> int | None:
    """The oldest driver (major version) that runs this CUDA; None when unknown."""
    major = int(cuda_version.split(".")[0]) if cuda_version else None
    return MIN_DRIVER.get(major) if major else None


def driver_verdict(driver_version: str, cuda_version: str | None) -> tuple[str, bool]:
    """The driver's version against what this torch build's CUDA needs: (text, ok)."""
    needed = needed_driver(cuda_version)
    try:
        found = int(driver_version.split(".")[0])
    except ValueError:
        return driver_version, True
    if needed is None:
        return driver_version, True
    if found < needed:
        return (f"{driver_version}: too old for CUDA {cuda_version}, which needs "
                f"{needed} or newer; update it from https://www.nvidia.com/drivers "
                "(until then vramguard uses the CPU)", False)
    return f"{driver_version} (CUDA {cuda_version} needs {needed} or newer)", True
