"""A CUDA *device* for the CUDA stand-in: tensors placed on "cuda" live on the CPU, and the
stand-in's caching allocator counts them, so code written for a GPU runs whole here.

``cuda_standin.CudaStandIn`` scripts the memory API; nothing there moves a tensor. Code
that puts a model and its inputs on the GPU (the GPU check's steps, the engine's CUDA
path) needs the placement too. This module gives it, for tests only (never imported from
``app/`` or ``bench/``):

- ``tensor.to("cuda")``, ``.cuda()``, ``module.to("cuda")`` and the factories
  (``torch.empty``, ``zeros``, ``ones``, ``randn``, ``rand``, ``full``) with a CUDA
  ``device`` make a CPU tensor with a storage of its own, and allocate its bytes from the
  stand-in (which raises CUDA's ``torch.OutOfMemoryError`` past its limit); the bytes go
  back to the stand-in's cache when the storage dies, as a freed block does on a GPU;
- a module's output is on the device when its input or its own weights are, and is
  counted the same way from the moment the module returns until it dies (a global forward
  hook, so it holds on every thread, the engine's device thread included). Activations a
  module makes and drops inside its forward are not seen: the peaks are those of the
  modules' outputs, a little below a GPU's for the same model;
- ``pin_memory`` copies (there is no page-locked memory), ``torch.cuda.Event`` times
  with the host's clock, and the device's identity answers as the stand-in's (an sm_90
  GPU, every kernel of this build).

``StandInDevice(cuda).install(monkeypatch)``; ``device.on_device(t)`` says whether ``t``
is counted on the device.
"""

from __future__ import annotations

import threading
import time
import types
import weakref
from typing import Any

import pytest
import torch
from cuda_standin import CudaStandIn
from torch.utils._pytree import tree_flatten

FACTORIES = ("empty", "zeros", "ones", "randn", "rand", "full")


def is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class StandInEvent:
    """``torch.cuda.Event``: work is synchronous here, so an event is a time stamp."""

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: StandInEvent) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end.at - self.at) * 1000.0


class StandInDevice:
    """Placement on the stand-in GPU; see the module's docstring."""

    def __init__(self, cuda: CudaStandIn) -> None:
        self.cuda = cuda
        self._lock = threading.RLock()
        self._handles: dict[int, int] = {}  # storage address -> the stand-in's handle
        self._hook: Any = None

    def on_device(self, tensor: torch.Tensor) -> bool:
        try:
            storage = tensor.untyped_storage()
            return storage.nbytes() > 0 and storage.data_ptr() in self._handles
        except (RuntimeError, NotImplementedError):  # a fake tensor (torch.export's tracing)
            return False

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor``'s storage on the device (once), until it dies."""
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a fake tensor: no memory anywhere
            return tensor
        if size == 0:
            return tensor
        with self._lock:
            if key in self._handles:
                return tensor
            self._handles[key] = self.cuda.alloc(size)
        weakref.finalize(storage, self._free, key)
        return tensor

    def _free(self, key: int) -> None:
        with self._lock:
            handle = self._handles.pop(key, None)
            if handle is not None:
                self.cuda.free(handle)

    # -- what is patched -----------------------------------------------------------------

    def install(self, monkeypatch: pytest.MonkeyPatch) -> StandInDevice:
        original_to = torch._C.TensorBase.to
        device = self

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            target, args, kwargs = device._cpu_arguments(args, kwargs)
            result = original_to(tensor, *args, **kwargs)
            if target or (target is None and device.on_device(tensor)):
                if not target and result is tensor:
                    return result  # already there, nothing converted
                if result.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() \
                        and not device.on_device(tensor):
                    result = result.clone()  # a copy to the device has a storage of its own
                return device.place(result)
            return result

        def cuda(tensor: torch.Tensor, device_index: Any = None, **kwargs: Any) -> torch.Tensor:
            return to(tensor, "cuda", **kwargs)

        def pin_memory(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
            return tensor.clone()

        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch.Tensor, "cuda", cuda)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        for name in FACTORIES:
            monkeypatch.setattr(torch, name, self._factory(getattr(torch, name)))
        self._hook = torch.nn.modules.module.register_module_forward_hook(self._outputs)
        monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device=None: types.SimpleNamespace(synchronize=lambda: None))
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.cuda.name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(torch.cuda, "get_arch_list",
                            lambda: torch._C._cuda_getArchFlags().split())
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
        return self

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _cpu_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                       ) -> tuple[bool | None, tuple[Any, ...], dict[str, Any]]:
        """``Tensor.to``'s arguments with every CUDA device made the CPU, and whether they
        named the device (True), the CPU (False) or no device (None)."""
        target: bool | None = None
        out = []
        for arg in args:
            if is_cuda(arg):
                target, arg = True, "cpu"
            elif isinstance(arg, torch.device | str):
                target = False
            elif isinstance(arg, torch.Tensor):  # to(other): other's device and dtype
                target = self.on_device(arg)
            out.append(arg)
        if "device" in kwargs:
            target = is_cuda(kwargs["device"])
            kwargs = {**kwargs, "device": "cpu"} if target else kwargs
        return target, tuple(out), kwargs

    def _factory(self, make: Any) -> Any:
        def factory(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            if not is_cuda(kwargs.get("device")):
                return make(*args, **kwargs)
            return self.place(make(*args, **{**kwargs, "device": "cpu"}))
        factory.__name__ = make.__name__
        return factory

    def _outputs(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A module's outputs are on the device when its input or its weights are."""
        inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        weight = next(module.parameters(recurse=False), None)
        if not (any(self.on_device(t) for t in inputs)
                or (weight is not None and self.on_device(weight))):
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor):
                self.place(tensor)
