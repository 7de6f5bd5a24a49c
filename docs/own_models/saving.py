"""The two small files vramguard reads beside a model: ``labels.txt`` and ``vramguard.toml``.

Python reads TOML (``tomllib``) but has no writer, so the manifest is plain text, read back
at once: a typo here fails the script, not the server.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path

from shapes_data import IMAGENET_MEAN, IMAGENET_STD, LABELS, RESIZE, SIZE

MANIFEST = "vramguard.toml"
LABELS_FILE = "labels.txt"


def write_labels(folder: Path, labels: Sequence[str] = LABELS) -> Path:
    """One label per line, in the order of the model's outputs."""
    path = folder / LABELS_FILE
    path.write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")
    return path


def _toml(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return str(value)


def write_manifest(folder: Path, *, format: str, file: str, task: str = "classify",
                   architecture: str | None = None, num_classes: int | None = None,
                   threshold: float | None = None, size: int = SIZE, resize: int = RESIZE,
                   interpolation: str = "bilinear", mean: Sequence[float] = IMAGENET_MEAN,
                   std: Sequence[float] = IMAGENET_STD,
                   labels: Sequence[str] = LABELS) -> Path:
    """``vramguard.toml`` (and ``labels.txt`` of ``labels`` unless the task is "embed"),
    checked by reading it back with ``tomllib``."""
    top = {"task": task}
    if task != "embed":
        write_labels(folder, labels)
        top["labels"] = LABELS_FILE
    if threshold is not None:
        top["threshold"] = threshold
    model = {"format": format, "file": file, "architecture": architecture,
             "num_classes": num_classes}
    preprocessing = {"size": size, "resize": resize, "interpolation": interpolation,
                     "mean": list(mean), "std": list(std), "colour": "rgb"}
    wanted = {**top, "model": {k: v for k, v in model.items() if v is not None},
              "preprocessing": preprocessing}
    lines = [f"{key} = {_toml(value)}" for key, value in top.items()]
    for section in ("model", "preprocessing"):
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml(value)}" for key, value in wanted[section].items()]
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != wanted:
        raise ValueError(f"the manifest written does not read back as meant:\n{text}")
    path = folder / MANIFEST
    path.write_text(text, encoding="utf-8")
    return path
