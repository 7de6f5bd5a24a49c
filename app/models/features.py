"""Penultimate features (embeddings): the input of the model's final classification layer.

A forward hook on that ``nn.Linear`` copies its input, the pooled features, during the
forward passes run inside ``tap_features``; the hook is removed on leaving, so plain
classification pays nothing. Hooks live on the module, so only the device thread, the
one thread that runs model code, may open a tap.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from app.models.types import ModelLoadError

IMAGENET_CLASSES = 1000


def classifier_layer(module: nn.Module, num_classes: int = IMAGENET_CLASSES) -> nn.Linear:
    """The last ``nn.Linear`` (in ``modules()`` order) with ``num_classes`` outputs.

    The last, not the first: some models (GoogLeNet, Inception v3) also hold auxiliary
    classifiers, registered before the main one.
    """
    found = [layer for layer in module.modules()
             if isinstance(layer, nn.Linear) and layer.out_features == num_classes]
    if not found:
        raise ModelLoadError(f"The model {type(module).__name__} has no final linear layer "
                             f"with {num_classes} outputs, so it cannot give features "
                             "(embeddings); it can still classify.")
    return found[-1]


def feature_dim(module: nn.Module, num_classes: int = IMAGENET_CLASSES) -> int:
    """Length of the feature vector ``tap_features`` records for one image."""
    return classifier_layer(module, num_classes).in_features


class FeatureTap:
    """What the hook recorded: one tensor per forward pass, in the order they ran."""

    def __init__(self) -> None:
        self._batches: list[torch.Tensor] = []

    def record(self, inputs: torch.Tensor) -> None:
        # Outside inference mode, so the copy is a normal tensor that later code may
        # also change in place (an inference tensor refuses that outside the mode).
        with torch.inference_mode(False):
            self._batches.append(inputs.detach().clone())

    def clear(self) -> None:
        """Forget what was recorded, e.g. before retrying a batch that ran out of memory."""
        self._batches.clear()

    @property
    def features(self) -> torch.Tensor:
        """(images, feature_dim) on the model's device: every recorded pass, concatenated."""
        if not self._batches:
            raise RuntimeError("No forward pass ran inside tap_features, so there are no "
                               "features to read.")
        if len(self._batches) == 1:
            return self._batches[0]
        return torch.cat(self._batches)


@contextmanager
def tap_features(module: nn.Module,
                 num_classes: int = IMAGENET_CLASSES) -> Iterator[FeatureTap]:
    """Record the final classification layer's input for the forward passes run inside."""
    tap = FeatureTap()

    def hook(_layer: nn.Module, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
        tap.record(inputs[0])

    handle = classifier_layer(module, num_classes).register_forward_hook(hook)
    try:
        yield tap
    finally:
        handle.remove()
