"""The device steps: what the machine is before anything costs GPU time.

imports (every module, before anything else, so a missing wheel is named), versions
(torch, CUDA, cuDNN, allocator settings), nvml (driver, MIG, totals before CUDA init) and
cuda_context (what creating the context costs, and whether NVML and CUDA agree).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.gpu_check import lite_standin
from bench.gpu_check.plan import (
    ALLOCATOR_ENV,
    DEFAULT_MODEL_IMPORTS,
    DRIVER_MODELS,
    LITE,
    MULTI_MODEL_IMPORTS,
    OPTIONAL_IMPORTS,
    REQUIRED_IMPORTS,
    MiB,
)
from bench.gpu_check.runner import Skip, part, type_name
from bench.gpu_check.state import Check, Nvml


def imports(check: Check, out: dict[str, Any]) -> str:
    wanted = [*REQUIRED_IMPORTS, *OPTIONAL_IMPORTS]
    required = set(REQUIRED_IMPORTS)
    if check.args.model == "efficientnet_lite0":
        wanted += DEFAULT_MODEL_IMPORTS
        required |= set(DEFAULT_MODEL_IMPORTS)
    wanted = list(dict.fromkeys([*wanted, *MULTI_MODEL_IMPORTS]))
    distributions = importlib.metadata.packages_distributions()
    failed = []
    for name in wanted:
        if name == lite_standin.PACKAGE and all(
                out.get(n, {}).get("ok") for n in ("torch", "efficientnet_lite_pytorch")):
            made = lite_standin.provide(check.workdir / "lite-standin")
            if made is not None:
                check.stand_ins[LITE[2]] = made
        started = time.perf_counter()
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a broken wheel can raise anything, not just ImportError
            out[name] = {"ok": False, "required": name in required,
                         "error": f"{type_name(exc)}: {exc}"}
            if name in required:
                failed.append(name)
            continue
        top = name.split(".")[0]
        version = getattr(module, "__version__", None)
        if version is None and top in distributions:
            with contextlib.suppress(Exception):
                version = importlib.metadata.version(distributions[top][0])
        out[name] = {"ok": True, "version": None if top == "app" else str(version),
                     "from": str(Path(getattr(module, "__file__", None) or "").parent),
                     "seconds": round(time.perf_counter() - started, 3)}
        if name == lite_standin.PACKAGE and LITE[2] in check.stand_ins:
            out[name]["stand_in"] = check.stand_ins[LITE[2]]
    torch = sys.modules.get("torch")
    check.has_torch = torch is not None
    check.pynvml = sys.modules.get("pynvml")
    if torch is not None:
        check.report["torch_version"] = str(torch.__version__)
    if failed:
        check.import_failed = True
        raise RuntimeError(f"cannot import {', '.join(failed)}: bring the wheels "
                           "(python -m bench.gpu_check --prepare) and put them on PYTHONPATH")
    return (f"torch {check.report['torch_version']} from {out['torch']['from']}; "
            f"{len(wanted)} modules")


def versions(check: Check, out: dict[str, Any]) -> str:
    import torch

    out.update(python=sys.version.split()[0], platform=platform.platform(),
               machine=platform.machine(), torch=str(torch.__version__),
               torch_git=torch.version.git_version, cuda_build=torch.version.cuda)
    part(out, "torchvision", lambda: sys.modules["torchvision"].__version__)
    part(out, "cuda_available", torch.cuda.is_available)
    part(out, "device_count", torch.cuda.device_count)
    # Loads cuDNN's library; creates no CUDA context, so "before init" stays true.
    part(out, "cudnn_version", torch.backends.cudnn.version)
    out["flags_at_start"] = check.flags()
    if check.cuda:
        part(out, "allocator_backend", torch.cuda.get_allocator_backend)
    out["allocator_env"] = {name: os.environ.get(name) for name in ALLOCATOR_ENV}
    out["vramguard_env"] = {k: v for k, v in os.environ.items() if k.startswith("VRAMGUARD_")}
    out["cpu_count"] = os.cpu_count()
    out["torch_threads"] = torch.get_num_threads()
    out["plan"] = asdict(check.plan)
    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"cuDNN {out.get('cudnn_version')}")


def text(value: object) -> str:
    """NVML's strings: bytes from older bindings, str from newer."""
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml(check: Check, out: dict[str, Any]) -> str:
    import torch

    pynvml = check.pynvml
    if pynvml is None:
        raise Skip("nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        reason = f"NVML cannot start here ({type_name(exc)}: {exc})"
        if check.cuda:
            check.warn("nvml", f"{reason}: vramguard falls back to torch.cuda.mem_get_info")
        raise Skip(reason) from None

    part(out, "driver_version", lambda: text(pynvml.nvmlSystemGetDriverVersion()))
    part(out, "cuda_driver_version", lambda: pynvml.nvmlSystemGetCudaDriverVersion_v2())
    part(out, "nvml_version", lambda: text(pynvml.nvmlSystemGetNVMLVersion()))
    part(out, "device_count", lambda: pynvml.nvmlDeviceGetCount())
    index = torch.device(check.device).index or 0
    by_index = pynvml.nvmlDeviceGetHandleByIndex(index)
    handle = by_index
    if check.cuda:
        # What the app does: the PCI address is robust to CUDA_VISIBLE_DEVICES (and, under
        # MIG, names the parent GPU). Device properties create no CUDA context.
        # Any: torch's stub of the properties lacks the PCI fields its runtime has.
        props: Any = torch.cuda.get_device_properties(index)
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        out["pci_bus_id"] = bus
        by_bus = part(out, "by_bus_id", lambda: pynvml.nvmlDeviceGetHandleByPciBusId(
            bus.encode()))
        if by_bus is not None:
            handle = by_bus
            out["by_bus_id"] = "found"
            part(out, "bus_and_index_same_gpu", lambda: text(pynvml.nvmlDeviceGetUUID(
                by_bus)) == text(pynvml.nvmlDeviceGetUUID(by_index)))
    check.nvml = Nvml(pynvml, handle)
    part(out, "name", lambda: text(pynvml.nvmlDeviceGetName(handle)))
    part(out, "uuid", lambda: text(pynvml.nvmlDeviceGetUUID(handle)))
    modes = part(out, "driver_model", lambda: [DRIVER_MODELS.get(m, m) for m in
                                                pynvml.nvmlDeviceGetDriverModel(handle)])
    if modes is None:
        out["driver_model_note"] = "WDDM/TCC exist on Windows only; NVML says not supported"
    mig = part(out, "mig_mode", lambda: list(pynvml.nvmlDeviceGetMigMode(handle)))
    if mig and mig[0]:
        part(out, "mig_devices", lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        check.warn("nvml", "MIG is on: NVML's figures by bus id are the parent GPU's")
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    out["memory_v1"] = {"total": int(v1.total), "used": int(v1.used), "free": int(v1.free)}
    part(out, "memory_v2", lambda: {
        k: int(getattr(info, k)) for info in [pynvml.nvmlDeviceGetMemoryInfo(
            handle, version=pynvml.nvmlMemory_v2)]
        for k in ("total", "reserved", "used", "free")})
    out["per_process"] = check.per_process()
    # A context created before the stage called "before init" would list us here.
    out["pid_listed_before_init"] = bool(out["per_process"].get("matched"))
    return (f"{out.get('name')}, driver {out.get('driver_version')}, MIG {mig}, "
            f"used {int(v1.used) // MiB} MiB before init")


def cuda_context(check: Check, out: dict[str, Any]) -> str:
    import torch

    dev = torch.device(check.device)
    if dev.index is None:
        dev = torch.device("cuda", 0)
    used_before = check.nvml_used()
    started = time.perf_counter()
    torch.cuda.init()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    torch.cuda.set_device(dev)
    probe = torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    out["seconds"] = round(time.perf_counter() - started, 3)
    check.dev, check.cuda_ready = dev, True
    props = torch.cuda.get_device_properties(dev)
    out["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count,
                     "total_memory": int(props.total_memory)}
    part(out["device"], "uuid", lambda: str(props.uuid))
    check.report["device_name"] = props.name
    free, total = torch.cuda.mem_get_info(dev)
    out["mem_get_info"] = {"free": int(free), "total": int(total)}
    used_after = check.nvml_used()
    if used_before is not None and used_after is not None:
        out["context_bytes_nvml"] = used_after - used_before
    totals: dict[str, Any] = {"mem_get_info": int(total), "device_properties":
                              int(props.total_memory)}
    if check.nvml is not None:
        found = check.report["steps"]["nvml"].get("result", {})
        totals["nvml_v1"] = found.get("memory_v1", {}).get("total")
        totals["nvml_v2"] = (found.get("memory_v2") or {}).get("total")
        if totals["nvml_v1"]:
            gap = abs(totals["nvml_v1"] - total) / total
            totals["nvml_v1_vs_cuda_pct"] = round(100 * gap, 2)
            totals["over_2_pct"] = gap > 0.02
    out["totals"] = totals
    out["per_process"] = check.per_process()
    del probe
    check.stage("context", out)
    context = out.get("context_bytes_nvml")
    return (f"{props.name}, {int(total) // MiB} MiB, context "
            f"{'?' if context is None else context // MiB} MiB, "
            f"PID matched {out['per_process'].get('matched')}")
