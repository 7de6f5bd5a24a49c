"""Train a tiny Hugging Face transformers image classifier and write it as the Hub has it.

    python docs/own_models/train_transformers.py OUT_DIR

writes ``OUT_DIR/transformers``: ``config.json`` (the labels), ``preprocessor_config.json``
(how to prepare a picture) and ``model.safetensors``, as ``save_pretrained`` writes them.
vramguard needs no manifest for it: ``vramguard models add OUT_DIR/transformers``.

The model is a small ResNet built from scratch, so nothing is downloaded. To use your own
pictures, change ``training_data`` (see the comment there) and pass your class names to
``new_model``. For real photos, start from a published model instead:
``ResNetForImageClassification.from_pretrained("microsoft/resnet-18", num_labels=...,
ignore_mismatched_sizes=True)`` and ``SIZE = 224``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import train_timm
from PIL import Image
from shapes_data import CROP_PCT, IMAGENET_MEAN, IMAGENET_STD, LABELS, SIZE, make_images
from torch import nn
from transformers import (
    AutoImageProcessor,
    AutoModelForImageClassification,
    ConvNextImageProcessor,
    ResNetConfig,
    ResNetForImageClassification,
)
from transformers.utils import logging as transformers_logging

FOLDER = "transformers"


def training_data(seed: int, count: int = train_timm.TRAIN_IMAGES
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs prepared as vramguard will prepare them, and their classes.

    Your own pictures: the comment in ``train_timm.training_data`` shows how
    (``torchvision.datasets.ImageFolder``, one sub-folder per class).
    """
    return train_timm.training_data(seed, count)


def new_model(labels: Sequence[str] = LABELS) -> ResNetForImageClassification:
    """A small ResNet (80 000 weights) whose ``config.json`` names each output's label."""
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1],
                          layer_type="basic", id2label=dict(enumerate(labels)),
                          label2id={label: index for index, label in enumerate(labels)})
    return ResNetForImageClassification(config)


def image_processor() -> ConvNextImageProcessor:
    """How transformers prepares a picture for the model, as vramguard does: the short side
    resized to ``SIZE / CROP_PCT`` (bilinear), the centre ``SIZE`` x ``SIZE`` cut out, then
    ImageNet's mean and std. transformers' ResNets use the ConvNeXT processor."""
    return ConvNextImageProcessor(size={"shortest_edge": SIZE}, crop_pct=CROP_PCT,
                                  resample=Image.Resampling.BILINEAR,
                                  image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD))


def train_model(seed: int = 0) -> nn.Module:
    """The transformers classifier, trained from scratch with the timm example's loop."""
    torch.manual_seed(seed)
    model = new_model()
    return train_timm.fit(model, *training_data(seed), seed=seed,
                          forward=lambda pixels: model(pixel_values=pixels).logits)


def save(model: nn.Module, out_dir: Path) -> Path:
    """``save_pretrained`` for the model and its processor, into one folder."""
    folder = out_dir / FOLDER
    transformers_logging.disable_progress_bar()  # its bars would clutter the output
    model.save_pretrained(folder)  # safetensors: vramguard never reads pytorch_model.bin
    image_processor().save_pretrained(folder)
    if not (folder / "model.safetensors").is_file() or (folder / "pytorch_model.bin").exists():
        raise RuntimeError(f"{folder} should hold model.safetensors and no pytorch_model.bin")
    return folder


def accuracy(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of ``inputs`` whose highest score is the right class."""
    with torch.no_grad():
        return float((model(pixel_values=inputs).logits.argmax(dim=1) == targets)
                     .float().mean())


def transformers_accuracy(folder: Path, seed: int, count: int = 300) -> float:
    """The same held-out check through transformers' own loading and processor: the folder
    works as a Hub download would."""
    model = AutoModelForImageClassification.from_pretrained(folder, local_files_only=True)
    processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    pairs = make_images(count, seed)
    inputs = processor([image for image, _ in pairs], return_tensors="pt")["pixel_values"]
    return accuracy(model.eval(), inputs, torch.tensor([label for _, label in pairs]))


def train(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Train the model and write its folder; prints the time and held-out accuracy."""
    start = time.perf_counter()
    model = train_model(seed)
    seconds = time.perf_counter() - start
    folder = save(model, out_dir)
    held_out = training_data(seed + 10_000, count=300)
    print(f"transformers: trained in {seconds:.1f} s, {accuracy(model, *held_out):.1%} "
          f"right on {len(held_out[1])} new pictures "
          f"({transformers_accuracy(folder, seed + 10_000):.1%} through transformers' own "
          "image processor)")
    print(f"  {FOLDER}: {folder}")
    return {FOLDER: folder}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where to write the model folder")
    train(parser.parse_args().out_dir)
