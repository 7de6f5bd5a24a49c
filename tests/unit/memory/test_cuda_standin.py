"""The CUDA / NVML stand-in keeps the documented semantics the CUDA-path tests rely on."""

from __future__ import annotations

import importlib
import os
import pickle

import pytest
import torch
from cuda_standin import (
    BLOCK,
    NVML_DEVICE_MIG_ENABLE,
    NVML_DRIVER_WDM,
    NVML_ERROR_NOT_SUPPORTED,
    SEGMENT,
    CudaStandIn,
    GiB,
    KiB,
    MiB,
    NVMLError,
    NvmlStandIn,
    install_gpu,
)


def test_allocated_never_exceeds_reserved_and_both_track_peaks():
    cuda = CudaStandIn(total=GiB)
    handles = [cuda.alloc(n) for n in (100, 3 * MiB, 5 * MiB + 1)]
    assert cuda.allocated == BLOCK + 3 * MiB + 5 * MiB + BLOCK
    assert cuda.reserved == SEGMENT + 4 * MiB + 6 * MiB >= cuda.allocated
    for handle in handles:
        cuda.free(handle)
    assert cuda.allocated == 0 and cuda.reserved == 12 * MiB  # freed blocks stay cached
    assert cuda.peak_allocated == 8 * MiB + 2 * BLOCK and cuda.peak_reserved == 12 * MiB


def test_reset_peak_sets_the_peaks_to_the_current_figures():
    cuda = CudaStandIn(total=GiB)
    keep = cuda.alloc(4 * MiB)
    cuda.forward(64 * MiB)
    assert cuda.max_memory_allocated() == 68 * MiB
    cuda.reset_peak_memory_stats()
    assert cuda.max_memory_allocated() == cuda.memory_allocated() == 4 * MiB
    assert cuda.max_memory_reserved() == cuda.memory_reserved() == 68 * MiB
    cuda.free(keep)


def test_the_cache_is_reused_and_empty_cache_returns_only_unused_segments():
    cuda = CudaStandIn(total=GiB)
    cuda.forward(10 * MiB)
    cuda.forward(8 * MiB)  # fits the cached 10 MiB segment: nothing new reserved
    assert cuda.reserved == 10 * MiB and cuda.stats["num_device_alloc"] == 1
    held = cuda.alloc(MiB)
    cuda.forward(20 * MiB)
    assert cuda.reserved == 10 * MiB + 20 * MiB
    cuda.empty_cache()
    assert cuda.reserved == 10 * MiB and cuda.allocated == MiB  # the used segment stays
    cuda.free(held)
    cuda.empty_cache()
    assert cuda.reserved == 0


def test_mem_get_info_is_free_and_total_of_the_whole_device():
    cuda = CudaStandIn(total=8 * GiB, context=300 * MiB, others=GiB)
    cuda.alloc(100 * MiB)
    free, total = cuda.mem_get_info()
    assert total == 8 * GiB and free == 8 * GiB - 300 * MiB - GiB - 100 * MiB


def test_oom_retries_after_freeing_the_cache_then_raises_cudas_error():
    cuda = CudaStandIn(total=GiB, context=0)
    cuda.alloc(600 * MiB)
    cuda.forward(100 * MiB)
    cuda.alloc(400 * MiB)  # fits only once the cached 100 MiB went back: a retry, no OOM
    assert cuda.stats["num_alloc_retries"] == 1 and cuda.reserved == 1000 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        cuda.alloc(200 * MiB)
    assert cuda.memory_stats()["num_ooms"] == 1


def test_the_fraction_caps_reserved_not_allocated():
    cuda = CudaStandIn(total=GiB, context=0)
    cuda.set_per_process_memory_fraction(0.5)
    cuda.alloc(MiB)  # reserves a 2 MiB segment
    with pytest.raises(torch.OutOfMemoryError):
        cuda.alloc(511 * MiB)  # 1 MiB allocated + 511 MiB fits 512, but 2 + 512 reserved does not
    with pytest.raises(ValueError):
        cuda.set_per_process_memory_fraction(1.5)


def test_scripted_failures_raise_the_given_exception_once():
    cuda = CudaStandIn(total=GiB)
    cuda.fail_next_alloc(torch.AcceleratorError("CUDA error: out of memory"))
    with pytest.raises(torch.AcceleratorError):
        cuda.forward(MiB)
    cuda.fail_next_alloc()
    with pytest.raises(torch.OutOfMemoryError):
        cuda.forward(MiB)
    cuda.forward(MiB)
    assert cuda.allocated == 0
    with pytest.raises(torch.OutOfMemoryError):
        cuda.forward(MiB, 2 * GiB)
    assert cuda.allocated == 0  # what the failed pass had allocated died with it


def test_memory_stats_counts_fragmentation():
    cuda = CudaStandIn(total=GiB)
    cuda.forward(200 * MiB)
    small = cuda.alloc(MiB)  # lands in the cached 200 MiB segment
    stats = cuda.memory_stats()
    assert stats["reserved_bytes.all.current"] == 200 * MiB
    assert stats["allocated_bytes.all.current"] == MiB
    assert stats["inactive_split_bytes.all.current"] == 199 * MiB
    cuda.free(small)


def test_install_patches_torch_cuda(monkeypatch, tmp_path):
    cuda = CudaStandIn(total=4 * GiB).install(monkeypatch)
    device = torch.device("cuda", 0)
    cuda.alloc(MiB)
    assert torch.cuda.is_available() and torch.cuda.memory_allocated(device) == MiB
    assert torch.cuda.get_device_properties(device).total_memory == 4 * GiB
    torch.cuda.memory._record_memory_history(max_entries=10, stacks="python")
    torch.cuda.memory._dump_snapshot(str(tmp_path / "s.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    assert pickle.loads((tmp_path / "s.pickle").read_bytes())["segments"]
    assert [h["stacks"] for h in cuda.history] == ["python", "all"]


def test_nvml_reports_the_whole_device_and_this_process(monkeypatch):
    cuda, nvml = install_gpu(monkeypatch, total=8 * GiB, context=300 * MiB, others=GiB)
    nvml.driver_reserved = 200 * MiB
    pynvml = importlib.import_module("pynvml")
    with pytest.raises(pynvml.NVMLError):  # uninitialised
        pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByPciBusId(b"00000000:41:00.0")
    cuda.alloc(100 * MiB)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert v1.total == v2.total == 8 * GiB
    assert v1.used == v2.used + v2.reserved == 300 * MiB + 100 * MiB + GiB + 200 * MiB
    assert v1.free == v2.free == cuda.mem_get_info()[0] - 200 * MiB
    (own,) = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert own.pid == os.getpid() and own.usedGpuMemory == 400 * MiB


def test_nvml_scripted_edge_cases(monkeypatch):
    cuda, nvml = install_gpu(monkeypatch, total=10 * GiB)
    nvml.total, nvml.mig, nvml.pid, nvml.process_used = 80 * GiB, True, 4242, None
    nvml.utilization = (97, 40)
    pynvml = importlib.import_module("pynvml")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMigMode(handle)[0] == NVML_DEVICE_MIG_ENABLE
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).total != cuda.mem_get_info()[1]
    (own,) = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert own.pid != os.getpid() and own.usedGpuMemory is None
    assert pynvml.nvmlDeviceGetUtilizationRates(handle).gpu == 97
    with pytest.raises(NVMLError) as error:
        pynvml.nvmlDeviceGetDriverModel(handle)
    assert error.value.value == NVML_ERROR_NOT_SUPPORTED
    nvml.driver_model = NVML_DRIVER_WDM
    assert pynvml.nvmlDeviceGetDriverModel(handle)[0] == pynvml.NVML_DRIVER_WDM
    nvml.fail("nvmlDeviceGetMemoryInfo", times=1)
    with pytest.raises(pynvml.NVMLError, match="Unknown"):
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).total == 80 * GiB


def test_small_blocks_share_a_segment_and_large_ones_never_use_it():
    cuda = CudaStandIn(total=GiB)
    small = [cuda.alloc(100 * KiB) for _ in range(30)]  # 20 per 2 MiB segment: two
    assert cuda.reserved == 2 * SEGMENT and cuda.allocated == 30 * 100 * KiB
    for handle in small:
        cuda.free(handle)
    cuda.alloc(2 * MiB)  # the free small segments are not for it
    assert cuda.reserved == 3 * SEGMENT


def test_nvml_shuts_down_at_the_last_of_its_initializations(monkeypatch):
    nvml = NvmlStandIn(CudaStandIn(total=GiB)).module
    nvml.nvmlInit()
    nvml.nvmlInit()  # another user of NVML in the same process
    nvml.nvmlShutdown()
    assert nvml.nvmlDeviceGetCount() == 1  # the first one's session is still open
    nvml.nvmlShutdown()
    with pytest.raises(NVMLError):
        nvml.nvmlDeviceGetCount()
