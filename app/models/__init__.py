"""Model registry: build a classifier by name, load its weights, know its labels."""

from app.models.registry import DEFAULT_MODEL, available_models, load_model, resolve_weights
from app.models.types import LoadedModel, ModelLoadError

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelLoadError",
    "available_models",
    "load_model",
    "resolve_weights",
]
