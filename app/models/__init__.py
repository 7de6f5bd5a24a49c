"""Model registry: build a classifier by name, load its weights, know its labels."""

from app.models.catalogue import CatalogueEntry, builtin_catalogue
from app.models.features import FeatureTap, feature_dim, tap_features
from app.models.registry import DEFAULT_MODEL, available_models, load_model, resolve_weights
from app.models.types import LoadedModel, ModelLoadError

__all__ = [
    "DEFAULT_MODEL",
    "CatalogueEntry",
    "FeatureTap",
    "LoadedModel",
    "ModelLoadError",
    "available_models",
    "builtin_catalogue",
    "feature_dim",
    "load_model",
    "resolve_weights",
    "tap_features",
]
