"""Live tensor bytes on the CPU, counted the way CUDA's allocator counts them on a GPU.

A ``TorchDispatchMode`` sees every tensor an operator creates on the thread
that enters it; each new storage adds its bytes and a finalizer takes them off
when the storage dies. With a cap, an allocation that takes the live total
over it raises the same ``torch.OutOfMemoryError`` CUDA raises, so the OOM
recovery paths run on the real model's real allocations without a GPU.

It costs a Python call per operator (about 10-30 % of a small model's forward
pass), so the engine enters it only while profiling and when a cap is set.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class LiveTensorTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: no hints
    """Counts live storage bytes created under it; optionally refuses to pass ``cap``.

    ``base`` is memory held outside the tracker (the weights) that counts
    against the cap, as it would on a GPU.
    """

    def __init__(self, cap: int | None = None, base: int = 0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.cap = cap
        self.base = base
        self.live = 0
        self.peak = 0
        self._storages: dict[int, int] = {}
        self._lock = threading.Lock()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        key = storage.data_ptr()
        if size == 0 or key in self._storages:
            return
        with self._lock:
            if self.cap is not None and self.base + self.live + size > self.cap:
                raise torch.OutOfMemoryError(
                    f"CPU memory cap: tried to allocate {size} bytes with "
                    f"{self.base + self.live} of {self.cap} bytes in use")
            self._storages[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        with self._lock:
            if self._storages.pop(key, None) is not None:
                self.live -= size
