"""Train a multilabel model and make an embedding model, and write each for vramguard.

    python docs/own_models/multilabel_and_embed.py OUT_DIR

writes two folders under OUT_DIR, each with weights and a manifest (``vramguard.toml``):

- ``multilabel``: says which colours a picture holds, any of red, green and blue (a score
  per colour; vramguard answers every colour scoring above 0.5).
- ``embed``: answers a list of numbers per picture (features) instead of labels. Pictures
  that look alike get similar numbers, which is what a search for similar pictures, or
  grouping pictures, needs. It is the timm example's classifier without its last layer.

To use your own pictures, change ``training_data`` (see the comment there) and pass your
label names to ``write_manifest`` (``labels=``); the embedding model takes any classifier.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import safetensors.torch
import timm
import torch
import train_timm
from saving import write_manifest
from shapes_data import LABELS, make_multilabel_images, to_batch
from torch import nn

MULTILABEL_STEPS = 60  # three answers per picture take a little longer to learn than one
THRESHOLD = 0.5
HELD_OUT = 300


def training_data(seed: int, count: int = train_timm.TRAIN_IMAGES
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs prepared as vramguard will prepare them, and for each a 0/1 per label
    (1: the label is in the picture).

    Your own pictures: a list of ``(image, [label index, ...])`` pairs, for example read
    from a spreadsheet of file names and labels, takes the place of
    ``make_multilabel_images``.
    """
    pairs = make_multilabel_images(count, seed)
    present = torch.zeros(len(pairs), len(LABELS))
    for row, (_, labels) in enumerate(pairs):
        present[row, labels] = 1.0
    return to_batch([image for image, _ in pairs]), present


def train_multilabel(seed: int = 0) -> nn.Module:
    """A timm model with one independent score per label (a sigmoid each, not a softmax),
    trained from scratch with binary cross-entropy."""
    torch.manual_seed(seed)
    model = timm.create_model(train_timm.ARCHITECTURE, num_classes=len(LABELS))
    return train_timm.fit(model, *training_data(seed), seed=seed,
                          loss=nn.functional.binary_cross_entropy_with_logits,
                          steps=MULTILABEL_STEPS)


def embedding_model(classifier: nn.Module) -> nn.Module:
    """``classifier`` without its last layer, built as vramguard builds an embed model
    (``timm.create_model(ARCHITECTURE, num_classes=0)``) so that its weights fit exactly."""
    model = timm.create_model(train_timm.ARCHITECTURE, num_classes=0)
    kept = model.state_dict().keys()
    model.load_state_dict({k: v for k, v in classifier.state_dict().items() if k in kept},
                          strict=True)
    return model.eval()


def save(model: nn.Module, folder: Path, task: str, *, threshold: float | None = None,
         num_classes: int | None = None) -> Path:
    """The weights as safetensors, and the manifest saying what they are."""
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(model.state_dict(), folder / "weights.safetensors")
    write_manifest(folder, format="timm", file="weights.safetensors", task=task,
                   architecture=train_timm.ARCHITECTURE, threshold=threshold,
                   num_classes=num_classes)
    return folder


def exact_sets(model: nn.Module, inputs: torch.Tensor, present: torch.Tensor) -> float:
    """The share of pictures whose labels scoring above the threshold are exactly the
    labels in the picture (none missing, none extra)."""
    with torch.no_grad():
        found = torch.sigmoid(model(inputs)) > THRESHOLD
    return float((found == present.bool()).all(dim=1).float().mean())


def similarities(model: nn.Module, inputs: torch.Tensor, classes: torch.Tensor
                 ) -> tuple[float, float]:
    """The mean cosine similarity of the features of two pictures of the same class, and
    of two of different classes (1: the same direction, 0: unrelated)."""
    with torch.no_grad():
        features = nn.functional.normalize(model(inputs), dim=1)
    cosine = features @ features.T
    same = classes[:, None] == classes[None, :]
    other_picture = ~torch.eye(len(classes), dtype=torch.bool)
    return float(cosine[same & other_picture].mean()), float(cosine[~same].mean())


def train(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Train both models and write their folders; prints what each does on new pictures."""
    start = time.perf_counter()
    multilabel = train_multilabel(seed)
    seconds = time.perf_counter() - start
    folders = {"multilabel": save(multilabel, out_dir / "multilabel", "multilabel",
                                  threshold=THRESHOLD)}
    held_out = training_data(seed + 10_000, count=HELD_OUT)
    print(f"multilabel: trained in {seconds:.1f} s, exactly the right colours for "
          f"{exact_sets(multilabel, *held_out):.1%} of {HELD_OUT} new pictures")
    start = time.perf_counter()
    embed = embedding_model(train_timm.train_model(seed))
    seconds = time.perf_counter() - start
    folders["embed"] = save(embed, out_dir / "embed", "embed", num_classes=0)
    within, across = similarities(embed, *train_timm.training_data(seed + 10_000, HELD_OUT))
    print(f"embed: trained in {seconds:.1f} s; on {HELD_OUT} new pictures, two of the same "
          f"colour are {within:.2f} alike on average, two of different colours {across:.2f} "
          "(cosine similarity: 1 is alike, 0 unrelated)")
    for name, folder in folders.items():
        print(f"  {name}: {folder}")
    return folders


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where to write the model folders")
    train(parser.parse_args().out_dir)
