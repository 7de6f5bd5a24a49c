"""`vramguard doctor`: what this computer has, and whether the model can run on it."""

from __future__ import annotations

import platform
import sys
import time

from app import __version__
from app.config import Settings, default_config_file


def _line(name: str, value: object, ok: bool = True) -> None:
    mark = "ok " if ok else "!! "
    print(f"{mark}{name:<22} {value}")


def run_doctor(settings: Settings) -> int:
    """Print one line per check; exit status 1 when any check found a problem."""
    import torch
    import torchvision

    from app.engine.device import DeviceError, resolve_device
    from app.models import ModelLoadError, load_model

    problems = 0
    _line("vramguard", __version__)
    _line("python", f"{platform.python_version()} ({sys.executable})")
    _line("platform", platform.platform())
    _line("torch", f"{torch.__version__} (built for CUDA {torch.version.cuda or 'none'})")
    _line("torchvision", torchvision.__version__)
    _line("config file", default_config_file())
    _line("cache folder", f"{settings.cache_dir} ({'on' if settings.cache else 'off'})")
    cuda = torch.cuda.is_available()
    _line("NVIDIA GPU", "available" if cuda else "none found (vramguard will use the CPU)")
    for index in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(index)
        _line(f"  cuda:{index}", f"{props.name}, {props.total_memory / 1024**3:.1f} GiB")
    try:
        device = resolve_device(settings.device)
        _line("device", f"{device} (setting: {settings.device})")
    except DeviceError as exc:
        _line("device", exc, ok=False)
        return 1
    try:
        started = time.perf_counter()
        model = load_model(settings.model, device, settings.weights)
        crop = model.preprocessing.crop
        with torch.inference_mode():
            model.module(torch.zeros(1, 3, crop, crop, device=device))
        elapsed = time.perf_counter() - started
        _line("model", f"{model.name} loaded and ran in {elapsed:.2f} s ({model.weights_file})")
    except (ModelLoadError, RuntimeError, OSError) as exc:
        _line("model", exc, ok=False)
        problems += 1
    print("all checks passed" if not problems else f"{problems} problem(s) found")
    return 1 if problems else 0
