"""Where models come from: the built-in ones and the models folder, as one catalogue.

The engine asks this, never the registry or the store directly, whether a name is a
model, where its weights are and how to build it; so a route, ``/v2`` metadata and the
tray all see own models beside the built-in ones. An own model's folder passes its trial
(``check``, blocking: the engine runs it off the event loop and off the device thread)
before ``load`` builds it on the device thread.
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.errors import ModelUnusable
from app.models import efficientnet_lite, registry, torchvision_models
from app.models.catalogue import CatalogueEntry, builtin_catalogue
from app.models.own.loading import load_own
from app.models.own.manifest import FolderError
from app.models.own.store import OwnEntry, OwnModels
from app.models.types import LoadedModel, ModelLoadError


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a built-in model's (so no own model may take it)."""
    return name in efficientnet_lite.MODELS or name in torchvision_models.names()


def own_entry(entry: OwnEntry) -> CatalogueEntry:
    described = entry.description
    if described is None:
        return CatalogueEntry(entry.name, "own", 0, False, entry.error)
    return CatalogueEntry(entry.name, "own", described.preprocessing.crop, True, "",
                          task=described.task, format=described.format,
                          labels=len(described.labels),
                          channels=described.preprocessing.channels)


class ModelSources:
    """The built-in models and the models folder of one vramguard."""

    def __init__(self, own: OwnModels) -> None:
        self.own = own
        self._loaded: dict[str, tuple[int, ...] | None] = {}  # own models' stamps at load

    def catalogue(self, fresh: bool = False) -> list[CatalogueEntry]:
        """Every model: the built-in ones, then the own ones (``fresh``: read the models
        folder now, not at most a few seconds ago)."""
        return [*builtin_catalogue(), *(own_entry(e) for e in self.own.scan(force=fresh))]

    def _own(self, name: str) -> OwnEntry | None:
        """The own model ``name``; a built-in name never looks in the models folder (no own
        model may take one, and a miss there rescans the folder: not per request)."""
        return None if is_builtin(name) else self.own.get(name)

    def entry(self, name: str) -> CatalogueEntry | None:
        own = self._own(name)
        if own is not None:
            return own_entry(own)
        return next((e for e in builtin_catalogue() if e.name == name), None)

    def format_of(self, name: str) -> str:
        """``name``'s format (timm, onnx, torchscript, ...), a built-in's family; "" for a
        name the catalogue does not list."""
        entry = self.entry(name)
        return "" if entry is None else entry.format or entry.family

    def knows(self, name: str) -> bool:
        """Whether ``name`` is exactly a model the catalogue lists."""
        return self._own(name) is not None or any(
            e.name == name for e in builtin_catalogue())

    def is_own(self, name: str) -> bool:
        return self._own(name) is not None

    def check(self, name: str) -> None:
        """An own model's trial, once per content (blocking: a child process); 422
        ``model_unusable`` saying what is wrong. Nothing to check for a built-in model."""
        if not self.is_own(name):
            return
        try:
            self.own.ensure_checked(name)
        except FolderError as exc:
            raise ModelUnusable(f"The model {name} cannot be served: {exc}") from None

    def weights_path(self, name: str, weights: Path | None = None) -> Path:
        """The weights file, or an own model's folder."""
        own = self._own(name)
        if own is not None:
            return own.folder
        return registry.resolve_weights(name, weights)

    def load(self, name: str, device: torch.device, weights: Path | None = None
             ) -> LoadedModel:
        """Build ``name`` on ``device``: an own model once it has passed its check."""
        own = self._own(name)
        if own is None:
            return registry.load_model(name, device, weights)
        try:
            version = self.own.ensure_checked(name)
        except FolderError as exc:
            raise ModelLoadError(f"The model {name} cannot be served: {exc}") from None
        stamp = self.own.stamp(name)
        loaded = load_own(own, version, device)
        self._loaded[name] = stamp
        return loaded

    def withdrawn(self, name: str) -> bool:
        """Whether the own model loaded as ``name`` has since been removed or replaced in
        the models folder (so what is loaded is no longer what the catalogue lists)."""
        return name in self._loaded and self.own.stamp(name) != self._loaded[name]
