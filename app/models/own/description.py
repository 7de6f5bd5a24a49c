"""What a model folder holds, read without torch: from its ``vramguard.toml``, or, for a
Hugging Face folder as downloaded, from its ``config.json`` (``hf_config``).

Cheap enough for the catalogue to call on every scan: a few small files are read, the
weights only checked (``folder_files``), nothing is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.models.own import hf_config
from app.models.own.folder_files import SAFE_CONVERSION, check_safetensors, inside, is_pickle
from app.models.own.manifest import MANIFEST, FolderError, Manifest, read_manifest
from app.preprocessing import Preprocessing

MAX_LABELS = 100_000
MAX_LABEL_CHARS = 200


@dataclass(frozen=True)
class ModelDescription:
    """Everything needed to build a folder's model and use its answers."""

    task: str  # "classify", "multilabel" or "embed"
    labels: tuple[str, ...]  # empty for "embed"
    threshold: float  # multilabel: a label is in the answer when its score is above it
    format: str  # one of manifest.FORMATS or manifest.HF_FORMATS
    file: str  # the weights or program file, inside the folder
    preprocessing: Preprocessing
    source: str  # the file that described it: vramguard.toml or config.json
    architecture: str | None = None
    num_classes: int | None = None
    model_args: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def outputs(self) -> int | None:
        """How many numbers the model must answer per image; None for embed (any)."""
        return len(self.labels) if self.labels else None


def read_labels(folder: Path, name: str) -> tuple[str, ...]:
    """One label per line; blank lines at the end are ignored, others are an error."""
    path = inside(folder, name)
    if path.stat().st_size > MAX_LABELS * (MAX_LABEL_CHARS + 1):
        raise FolderError(f"{name} is too large for a labels file")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    labels = tuple(line.strip() for line in lines)
    if not labels:
        raise FolderError(f"{name} has no labels: write one per line")
    for number, label in enumerate(labels, 1):
        if not label:
            raise FolderError(f"{name}, line {number}: a label is empty")
        if len(label) > MAX_LABEL_CHARS:
            raise FolderError(f"{name}, line {number}: a label is longer than "
                              f"{MAX_LABEL_CHARS} characters")
    if len(labels) > MAX_LABELS:
        raise FolderError(f"{name} has more than {MAX_LABELS} labels")
    return labels


def describe_folder(folder: Path) -> ModelDescription:
    """The folder's model, or FolderError saying what is wrong, in which file."""
    if not folder.is_dir():
        raise FolderError(f"{folder} is not a folder")
    manifest = read_manifest(folder)
    if manifest is not None:
        return _from_manifest(folder, manifest)
    if (folder / hf_config.CONFIG).exists():
        described = hf_config.describe(folder)
        _check_weights(folder, described.format, described.file)
        return described
    if (folder / hf_config.PICKLED_WEIGHTS).exists():
        raise FolderError(f"The folder has only {hf_config.PICKLED_WEIGHTS}, a pickle; "
                          f"vramguard never unpickles weights. Convert it: {SAFE_CONVERSION}")
    raise FolderError(f"The folder has neither {MANIFEST} nor a Hugging Face "
                      f"{hf_config.CONFIG}: vramguard cannot tell what model it holds "
                      "(see \"Serve your own model\" in the README)")


def _from_manifest(folder: Path, manifest: Manifest) -> ModelDescription:
    labels = read_labels(folder, manifest.labels) if manifest.labels else ()
    section = manifest.model
    _check_weights(folder, section.format, section.file)
    return ModelDescription(
        task=manifest.task, labels=labels, threshold=manifest.score_threshold,
        format=section.format, file=section.file, preprocessing=manifest.preprocessing.spec(),
        source=MANIFEST, architecture=section.architecture, num_classes=section.num_classes,
        description=manifest.description)


def _check_weights(folder: Path, form: str, name: str) -> None:
    """The cheap checks of the model's file, before any reader sees it."""
    path = inside(folder, name)
    if form in ("timm", "timm-hf", "transformers") or (
            form == "torchvision" and path.suffix == ".safetensors"):
        check_safetensors(path)
    elif form == "torchvision" and not is_pickle(path):
        raise FolderError(f"'{name}' is neither safetensors nor a torch.save state dict")
