"""What the multi-model step watches an engine do, and the dry mode's stand-in for a full GPU.

``ModelWatch`` wraps four of an engine's callables (each wrapper calls the original
unchanged) to record every load, warmup, unload and stored profile; ``ShortDevice`` raises
CUDA's out-of-memory on the CPU where a GPU a filler has filled would, so the dry mode
takes the engine's own out-of-memory-on-load path.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench.gpu_check.runner import type_name
from bench.gpu_check.state import Check

if TYPE_CHECKING:
    import torch
    from torch import nn

    from app.engine.engine import InferenceEngine, Runtime
    from app.engine.profiles import ModelProfile
    from app.memory.fit import MemoryFit
    from app.models import LoadedModel


class ShortDevice:
    """The dry mode's stand-in for a GPU that a filler tensor has left ``room`` bytes.

    Copying ``model``'s weights and each of its forward passes raise torch.OutOfMemoryError
    when they would not fit in the room plus what the models unloaded since gave back (a
    pass of n images needs the weights and ``fit.peak(n)``). Nothing fails to allocate on
    the CPU: the error is raised where a GPU would raise it (ModelWatch wraps the engine's
    load; a forward pre-hook), and the engine handles it as it would a GPU's."""

    def __init__(self, model: str, room: int, fit: MemoryFit) -> None:
        self.model = model
        self.room = room
        self.fit = fit
        self.active = True
        self.raised: list[str] = []

    def gave_back(self, nbytes: int) -> None:
        self.room += nbytes

    def copy_weights(self, weights: int) -> None:
        if self.active and weights > self.room:
            self.fail("copying the weights", weights)

    def forward_hook(self, weights: int) -> Callable[[nn.Module | None, tuple[torch.Tensor, ...]],
                                                     None]:
        def hook(module: nn.Module | None, args: tuple[torch.Tensor, ...]) -> None:
            images = int(args[0].shape[0])
            if self.active and weights + self.fit.peak(images) > self.room:
                self.fail(f"a forward pass of {images}", weights + self.fit.peak(images))
        return hook

    def fail(self, what: str, need: int) -> None:
        import torch

        self.raised.append(what)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. {what} needs {need} bytes, {self.room} are left (the dry "
            "mode's stand-in for a GPU a filler tensor has filled)")


class ModelWatch:
    """What an engine does while models load and unload: four of its callables wrapped
    (each wrapper calls the original unchanged). Each load and warmup with the exception
    that ended it and how the app classifies it; each unload with the memory it gave back
    and whether the model's module was freed; each profile stored. ``short``: the dry
    mode's stand-in device, fed by the loads and unloads."""

    def __init__(self, check: Check, engine: InferenceEngine) -> None:
        self.check = check
        self.started = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.modules: list[tuple[str, weakref.ref[nn.Module]]] = []
        self.short: ShortDevice | None = None
        load, warm_up = engine.load, engine.warm_up
        unload, put = engine._unload_on_device, engine.profiles.put

        def watched_load(name: str | None = None) -> LoadedModel:
            try:
                model = load(name)
                self.modules.append((model.name, weakref.ref(model.module)))
                short = self.short
                if short is not None and model.name == short.model:
                    from app.engine.engine import weights_bytes

                    size = weights_bytes(model)
                    short.copy_weights(size)
                    model.module.register_forward_pre_hook(short.forward_hook(size))
            except Exception as exc:
                self.note("load", name, exc)
                raise
            self.note("load", model.name)
            return model

        def watched_warm_up(model: LoadedModel, **kwargs: Any) -> Runtime:
            try:
                runtime = warm_up(model, **kwargs)
            except Exception as exc:
                self.note("warm_up", model.name, exc)
                raise
            self.note("warm_up", model.name, reused_profile=runtime.reused_profile)
            return runtime

        def watched_unload(name: str, reason: str, strict: bool) -> None:
            runtime = engine.runtimes.get(name)
            weights = None if runtime is None else int(runtime.memory.weights_bytes)
            module = None if runtime is None else weakref.ref(runtime.model.module)
            runtime = None  # no reference of ours may keep it alive
            before = check.device_memory(engine)
            unload(name, reason, strict)
            after = check.device_memory(engine)
            self.note("unload", name, reason=reason, weights_bytes=weights,
                      allocated_drop=before["allocated"] - after["allocated"],
                      reserved_drop=before.get("reserved", 0) - after.get("reserved", 0),
                      module_freed=module is None or module() is None)
            if self.short is not None and weights and name != self.short.model:
                self.short.gave_back(weights)

        def watched_put(profile: ModelProfile) -> None:
            self.note("profile_put", profile.key.model,
                      out_of_memory_on_load=profile.out_of_memory_on_load,
                      chosen_batch_size=profile.chosen_batch_size,
                      out_of_memory_at=profile.out_of_memory_at)
            put(profile)

        engine.load, engine.warm_up = watched_load, watched_warm_up  # type: ignore[method-assign]
        engine._unload_on_device = watched_unload  # type: ignore[method-assign]
        engine.profiles.put = watched_put  # type: ignore[method-assign]

    def note(self, event: str, model: str | None, exc: BaseException | None = None,
             **fields: Any) -> None:
        record: dict[str, Any] = {"event": event, "model": model,
                                  "at_s": round(time.monotonic() - self.started, 3), **fields}
        if exc is not None:
            from app.engine.oom import classify_error
            from app.engine.warmup import OutOfMemoryAtWarmup

            cause = exc.__context__ if isinstance(exc, OutOfMemoryAtWarmup) else None
            kind = ("out_of_memory" if isinstance(exc, OutOfMemoryAtWarmup)
                    else classify_error(exc).value)
            record.update(error=type_name(exc), kind=kind, message=str(exc)[:300])
            if cause is not None:
                record["cause"] = f"{type_name(cause)}: {str(cause)[:200]}"
        self.events.append(record)

    def since(self, index: int, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events[index:] if e["event"] == event]
