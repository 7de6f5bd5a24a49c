"""Train a small timm classifier and write it in every form vramguard serves.

    python docs/own_models/train_timm.py OUT_DIR

writes one folder per form under OUT_DIR: ``timm-hf`` (timm's own Hugging Face layout,
no manifest needed), ``timm`` (weights + manifest), ``torchscript``, ``export``
(``torch.export``), ``onnx`` and ``torchvision`` (a torchvision model, trained too).
Point vramguard at any one of them.

To use your own pictures, change ``training_data`` (see the comment there) and pass your
class names to ``write_manifest``; pick a bigger architecture and a bigger ``SIZE`` for
real photos. The training loop here (``fit``) is also used by the other examples.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import timm
import torch
import torchvision
from saving import write_manifest
from shapes_data import CROP_PCT, IMAGENET_MEAN, IMAGENET_STD, LABELS, SIZE, make_images, to_batch
from torch import nn

ARCHITECTURE = "test_byobnet"
TORCHVISION_ARCHITECTURE = "mobilenet_v3_small"
TRAIN_IMAGES = 480
STEPS = 40
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def training_data(seed: int, count: int = TRAIN_IMAGES) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs prepared as vramguard will prepare them, and their classes.

    Your own pictures: ``dataset = torchvision.datasets.ImageFolder("my_pictures")`` (one
    sub-folder per class) gives ``(image, class)`` pairs like ``make_images``; its labels
    are ``dataset.classes``, in alphabetical order.
    """
    pairs = make_images(count, seed)
    return to_batch([image for image, _ in pairs]), torch.tensor([label for _, label in pairs])


def recalibrate_batchnorm(model: nn.Module, inputs: torch.Tensor) -> None:
    """Set each BatchNorm's running mean and variance to those of the training inputs.

    After a few dozen steps the running averages still lag the weights, so the model in
    eval mode (as served) would answer worse than in training; one pass without gradients
    fixes that."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the whole pass
    model.train()
    with torch.no_grad():
        model(inputs)
    for norm, momentum in zip(norms, momenta, strict=True):
        norm.momentum = momentum
    model.eval()


def fit(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, seed: int = 0,
        loss: Loss = nn.functional.cross_entropy, steps: int = STEPS, lr: float = 3e-3,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """Train ``model`` on random batches of 32, then leave it in eval mode, ready to save.
    ``forward`` turns inputs into scores when the model's own call does not return them."""
    torch.set_num_threads(1)
    scores = forward or model
    order = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=lr, total_steps=steps)
    model.train()
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (32,), generator=order)
        optimiser.zero_grad()
        loss(scores(inputs[batch]), targets[batch]).backward()
        optimiser.step()
        schedule.step()
    recalibrate_batchnorm(model, inputs)
    return model


def train_model(seed: int = 0) -> nn.Module:
    """The timm classifier, trained from scratch (nothing is downloaded)."""
    torch.manual_seed(seed)
    model = timm.create_model(ARCHITECTURE, num_classes=len(LABELS))
    return fit(model, *training_data(seed), seed=seed)


def train_torchvision_model(seed: int = 0) -> nn.Module:
    """The same task for a torchvision model, trained on its own (it takes longer)."""
    torch.manual_seed(seed)
    model = getattr(torchvision.models, TORCHVISION_ARCHITECTURE)(num_classes=len(LABELS))
    return fit(model, *training_data(seed), seed=seed)


def save_all(model: nn.Module, out_dir: Path) -> dict[str, Path]:
    """``model`` (a timm model in eval mode) in each form, one folder each."""
    folders = {name: out_dir / name for name in
               ("timm-hf", "timm", "torchscript", "export", "onnx")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, 3, SIZE, SIZE)
    # timm's Hugging Face layout: config.json holds the architecture, the labels and how to
    # prepare pictures, so vramguard needs no manifest.
    timm.models.save_for_hf(model, folders["timm-hf"], model_config={"label_names": LABELS},
                            safe_serialization=True, data_config={
                                "input_size": (3, SIZE, SIZE), "crop_pct": CROP_PCT,
                                "interpolation": "bilinear", "mean": IMAGENET_MEAN,
                                "std": IMAGENET_STD})
    safetensors.torch.save_file(model.state_dict(), folders["timm"] / "weights.safetensors")
    write_manifest(folders["timm"], format="timm", file="weights.safetensors",
                   architecture=ARCHITECTURE)
    torch.jit.save(torch.jit.trace(model, example), folders["torchscript"] / "model.pt")
    write_manifest(folders["torchscript"], format="torchscript", file="model.pt")
    # The batch size may be 1 to 1024: vramguard sends as many pictures as fit in memory.
    batch = torch.export.Dim("batch", min=1, max=1024)
    exported = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(exported, folders["export"] / "model.pt2")
    write_manifest(folders["export"], format="export", file="model.pt2")
    # Opset 17: onnx2torch, which vramguard converts ONNX models with, has no converters
    # for some operators of opset 18 and later (ReduceMean, Constant).
    torch.onnx.export(model, (example,), folders["onnx"] / "model.onnx", dynamo=False,
                      opset_version=17, input_names=["pixels"], output_names=["scores"],
                      dynamic_axes={"pixels": {0: "batch"}, "scores": {0: "batch"}})
    write_manifest(folders["onnx"], format="onnx", file="model.onnx")
    return folders


def save_torchvision(model: nn.Module, out_dir: Path) -> Path:
    """A torchvision model's weights and the manifest that names its architecture."""
    folder = out_dir / "torchvision"
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(model.state_dict(), folder / "weights.safetensors")
    write_manifest(folder, format="torchvision", file="weights.safetensors",
                   architecture=TORCHVISION_ARCHITECTURE)
    return folder


def accuracy(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of ``inputs`` whose highest score is the right class."""
    with torch.no_grad():
        return float((model(inputs).argmax(dim=1) == targets).float().mean())


def train(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Train both models and write every form; prints the time and held-out accuracy."""
    held_out = training_data(seed + 10_000, count=300)
    folders = {}
    for name, trainer, saver in (("timm", train_model, save_all),
                                 ("torchvision", train_torchvision_model, save_torchvision)):
        start = time.perf_counter()
        model = trainer(seed)
        seconds = time.perf_counter() - start
        written = saver(model, out_dir)
        folders.update(written if isinstance(written, dict) else {name: written})
        print(f"{name}: trained in {seconds:.1f} s, {accuracy(model, *held_out):.1%} right "
              f"on {len(held_out[1])} new pictures")
    for name, folder in folders.items():
        print(f"  {name}: {folder}")
    return folders


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where to write the model folders")
    train(parser.parse_args().out_dir)
