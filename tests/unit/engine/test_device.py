"""Which device `auto` and `cuda` pick on GPUs the torch build cannot run (no GPU here:
torch.cuda is monkeypatched). CUDA 13 wheels carry sm_75 and newer, without PTX: a
GTX 10-series card (6.1) is found, then fails with "no kernel image" at warmup."""

from __future__ import annotations

import logging

import pytest
import torch

from app.engine.device import DeviceError, resolve_device, unsupported_gpu

CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
        arches: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA GeForce GTX")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arches)


def test_auto_falls_back_to_the_cpu_for_a_gpu_too_old_and_says_why(monkeypatch, caplog):
    gpu(monkeypatch, (6, 1), CU130)
    with caplog.at_level(logging.WARNING):
        assert resolve_device("auto") == torch.device("cpu")
    assert "Using the CPU instead of the GPU" in caplog.text
    assert "compute capability 6.1" in caplog.text and "7.5 and newer" in caplog.text


def test_a_gpu_the_build_covers_is_used(monkeypatch):
    gpu(monkeypatch, (8, 9), CU130)  # Ada: sm_86's binaries run on 8.9
    assert resolve_device("auto") == torch.device("cuda:0")
    gpu(monkeypatch, (12, 0), CU130)
    assert resolve_device("cuda") == torch.device("cuda", 0)


def test_ptx_covers_newer_gpus(monkeypatch):
    gpu(monkeypatch, (9, 0), ["sm_75", "compute_80"])
    assert unsupported_gpu(0) is None


def test_asking_for_a_gpu_too_old_is_refused_with_advice(monkeypatch):
    gpu(monkeypatch, (5, 2), CU130)
    with pytest.raises(DeviceError, match=r"too old for this build.*--device cpu"):
        resolve_device("cuda")


def test_the_driver_is_held_to_what_cuda_13_needs():
    from app.engine.device import driver_verdict

    text, ok = driver_verdict("572.16", "13.0")
    assert not ok and "needs 580 or newer" in text
    assert driver_verdict("581.29", "13.0") == ("581.29 (CUDA 13.0 needs 580 or newer)", True)
    assert driver_verdict("581.29", None)[1]


def test_the_engine_reports_why_it_runs_on_the_cpu_and_the_tray_shows_it(monkeypatch, tmp_path):
    """The log is not where a desktop user looks: the memory report carries the reason,
    and the tray menu says it in a line."""
    from asgi import make_settings
    from samples import sample

    from app.engine.engine import InferenceEngine
    from tray.text import menu_lines

    gpu(monkeypatch, (6, 1), CU130)
    engine = InferenceEngine(make_settings(tmp_path, device="auto"))
    assert engine.device == torch.device("cpu")
    assert engine.cpu_instead_of_gpu is not None
    assert "compute capability 6.1" in engine.cpu_instead_of_gpu
    shown = menu_lines(sample(cpu_instead_of_gpu=engine.cpu_instead_of_gpu))
    assert "Using the CPU: this GPU is too old for this version" in shown
    gpu(monkeypatch, (8, 9), CU130)
    assert InferenceEngine(make_settings(tmp_path, device="auto")).cpu_instead_of_gpu is None


def test_a_driver_too_old_for_cuda_is_the_reason_and_the_tray_says_so(monkeypatch):
    """Issue 27: a driver older than 580 makes CUDA 13 say only that no GPU is available;
    the fallback was silent outside `doctor`. The reason now says it, and the tray's line
    asks for a driver update."""
    from samples import sample

    from app.engine.device import cpu_fallback_reason
    from tray.text import menu_lines

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    reason = cpu_fallback_reason("auto", driver_version=lambda: "572.16")
    assert reason is not None and "572.16" in reason and "580 or newer" in reason
    assert "Using the CPU: update the NVIDIA driver" in menu_lines(
        sample(cpu_instead_of_gpu=reason))
    assert cpu_fallback_reason("auto", driver_version=lambda: "581.29") is None
    assert cpu_fallback_reason("auto", driver_version=lambda: None) is None  # no GPU at all
    assert cpu_fallback_reason("cpu", driver_version=lambda: "572.16") is None  # as asked
