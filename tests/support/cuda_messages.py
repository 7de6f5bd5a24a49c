"""The error messages CUDA's libraries really print, read from the libraries torch ships
(``nvidia/cu13``, ``nvidia/cudnn``): their string functions are table lookups that need no
GPU. Each is worded the way torch 2.x raises it (c10/cuda/CUDAException.h,
ATen/cudnn/Exceptions.h, ATen/cuda/CUDABlas's ``TORCH_CUDABLAS_CHECK``), so the OOM and
sticky-error tests check what a user's GPU would print, not what we think it prints."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest
import torch

NVIDIA = Path(torch.__file__).resolve().parents[1] / "nvidia"
LIBRARIES = {"cudart": "cu13/lib/libcudart.so.13", "cublas": "cu13/lib/libcublas.so.13",
             "cudnn": "cudnn/lib/libcudnn.so.9"}
# Status codes of cuDNN 9 (cudnn_graph.h) and cuBLAS (cublas_api.h) the app must know.
CUDNN_DEVICE_ALLOCATION_FAILED = 4004
CUDNN_HOST_ALLOCATION_FAILED = 4003
CUDNN_EXECUTION_FAILED_CUDA_DRIVER = 5001
CUBLAS_NOT_INITIALIZED = 1
CUBLAS_ALLOC_FAILED = 3
KERNEL_ERRORS_NOTE = ("CUDA kernel errors might be asynchronously reported at some other API "
                      "call, so the stacktrace below might be incorrect.")


@functools.cache
def _library(name: str) -> ctypes.CDLL:
    path = NVIDIA / LIBRARIES[name]
    if not path.exists():
        pytest.skip(f"this torch build ships no {path.name}")
    return ctypes.CDLL(str(path))


def _text(name: str, function: str, code: int) -> str:
    fn = getattr(_library(name), function)
    fn.restype = ctypes.c_char_p
    fn.argtypes = [ctypes.c_int]
    return bytes(fn(code)).decode()


def cuda_runtime_error(code: int) -> torch.AcceleratorError:
    """What torch raises for a failed CUDA runtime call: ``error_code`` set, as C++ does."""
    exc = torch.AcceleratorError(
        f"CUDA error: {_text('cudart', 'cudaGetErrorString', code)}\n{KERNEL_ERRORS_NOTE}")
    exc.error_code = code  # type: ignore[attr-defined]  # set by torch's C++ side
    return exc


def cudnn_error(code: int, detail: str = "") -> RuntimeError:
    """``AT_CUDNN_CHECK``'s error, with cuDNN 9's last-error detail where there is one."""
    return RuntimeError(f"cuDNN error: {_text('cudnn', 'cudnnGetErrorString', code)}{detail}")


def cublas_error(code: int, call: str) -> RuntimeError:
    """``TORCH_CUDABLAS_CHECK``'s error: the status's name and the call that failed."""
    return RuntimeError(
        f"CUDA error: {_text('cublas', 'cublasGetStatusName', code)} when calling `{call}`")
