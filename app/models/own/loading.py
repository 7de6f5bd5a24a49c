"""An own model, once its folder has passed the trial, as a ``LoadedModel`` on a device."""

from __future__ import annotations

import torch

from app.models.features import feature_dim
from app.models.own.builders import build, in_eval_mode
from app.models.own.checks import check_model
from app.models.own.manifest import FolderError
from app.models.own.store import OwnEntry
from app.models.types import LoadedModel, ModelLoadError


def load_own(entry: OwnEntry, version: str, device: torch.device) -> LoadedModel:
    """Build ``entry``'s model, check it again here (the folder may have changed since its
    trial), and move it to ``device``; ModelLoadError saying why not."""
    described = entry.description
    if described is None:
        raise ModelLoadError(f"The model {entry.name} cannot be served: {entry.error}")
    try:
        module = build(entry.folder, described)
        outputs = check_model(module, described).outputs
    except FolderError as exc:
        raise ModelLoadError(f"The model {entry.name} cannot be served: {exc}") from None
    in_eval_mode(module.to(device))
    if described.task == "embed":
        features = outputs
    else:
        try:
            features = feature_dim(module, len(described.labels))
        except ModelLoadError:
            features = 0
    return LoadedModel(
        name=entry.name, module=module, labels=list(described.labels),
        preprocessing=described.preprocessing, weights_file=entry.folder,
        weights_version=version, device=device, feature_dim=features, task=described.task,
        threshold=described.threshold, family=described.format, own=True)
