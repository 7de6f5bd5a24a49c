"""Pick the torch device from the `device` setting."""

from __future__ import annotations

import torch


class DeviceError(Exception):
    """The requested device does not exist on this computer."""


def resolve_device(setting: str) -> torch.device:
    """`auto` takes the first NVIDIA GPU when there is one and the CPU otherwise."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
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
        device = torch.device("cuda", index)
    return device
