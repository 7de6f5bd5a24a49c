"""Build a folder's model as a torch module on the CPU, one function per format.

timm, torchvision's model builders, transformers, onnx and onnx2torch are imported only
here, and only for a model that needs them: a start that serves the built-in models pays
nothing for them. Weights are read from safetensors, or (torchvision ``.pth``) with
``torch.load(weights_only=True)``; a TorchScript, ``.pt2`` or ONNX file is a program and
is first run by the trial in a child process (``trial``), never first here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.models.own.description import ModelDescription
from app.models.own.folder_files import check_export_archive, inside
from app.models.own.manifest import FolderError


def build(folder: Path, described: ModelDescription) -> nn.Module:
    """The folder's model in eval mode on the CPU; FolderError when it cannot be built."""
    builder = BUILDERS[described.format]
    path = inside(folder, described.file)
    try:
        module = builder(folder, path, described)
    except FolderError:
        raise
    except ImportError as exc:
        raise FolderError(f"Loading a {described.format} model needs {exc.name}, which "
                          "this installation lacks; reinstall vramguard") from None
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise FolderError(f"{described.file} could not be loaded as a {described.format} "
                          f"model: {first}") from None
    return in_eval_mode(module)


def in_eval_mode(module: nn.Module) -> nn.Module:
    """``module.eval()``; a ``torch.export`` program refuses it, and needs none: it was
    traced in the mode it was exported in."""
    try:
        return module.eval()
    except NotImplementedError:
        return module


def _state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise FolderError(f"{path.name} is not a state dict (a table of tensors)")
    return loaded


def _load_strict(module: nn.Module, path: Path, architecture: str) -> nn.Module:
    try:
        module.load_state_dict(_state(path), strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "they do not match"
        raise FolderError(f"The weights in {path.name} do not fit the architecture "
                          f"'{architecture}': {first}") from None
    return module


def _classes(described: ModelDescription) -> int:
    if described.num_classes is not None:
        return described.num_classes
    return len(described.labels)


def _timm(folder: Path, path: Path, described: ModelDescription) -> nn.Module:
    import timm

    name = described.architecture or ""
    if not timm.is_model(name):
        raise FolderError(f"timm has no architecture '{name}' (timm {timm.__version__})")
    args = dict(described.model_args)
    args.pop("num_classes", None)  # the labels (or the manifest) say how many
    args.setdefault("in_chans", described.preprocessing.channels)
    module = timm.create_model(name, pretrained=False, num_classes=_classes(described),
                               **args)
    return _load_strict(module, path, name)


def _torchvision(folder: Path, path: Path, described: ModelDescription) -> nn.Module:
    import torchvision.models

    name = described.architecture or ""
    if name not in torchvision.models.list_models(module=torchvision.models):
        raise FolderError(f"torchvision has no classification architecture '{name}'")
    module = torchvision.models.get_model(name, weights=None,
                                          num_classes=_classes(described))
    return _load_strict(module, path, name)


def _torchscript(folder: Path, path: Path, described: ModelDescription) -> nn.Module:
    module: nn.Module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    return module


def _export(folder: Path, path: Path, described: ModelDescription) -> nn.Module:
    check_export_archive(path)
    program = torch.export.load(str(path))
    return program.module()


def _onnx(folder: Path, path: Path, described: ModelDescription) -> nn.Module:
    import onnx
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data
    from onnx2torch import convert  # type: ignore[import-untyped]

    proto = onnx.load(str(path), load_external_data=False)
    outside = [tensor for tensor in _initializers(proto) if uses_external_data(tensor)]
    for tensor in outside:
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        inside(folder, location)
    if outside:
        load_external_data_for_model(proto, str(path.parent))
    _constants_as_initializers(proto)
    try:
        module: nn.Module = convert(proto)
    except NotImplementedError as exc:
        raise FolderError(f"{path.name} uses an ONNX operator that cannot be converted "
                          f"to torch: {str(exc).splitlines()[0]}; export it with "
                          "opset_version=17") from None
    return module


def _constants_as_initializers(proto: Any) -> None:
    """A ``Constant`` node holding a tensor, as the initializer it amounts to: onnx2torch
    1.5 has no converter for the opset 19 and later ``Constant`` that torch.onnx.export
    writes, and an initializer is the same value to every reader."""
    graph = proto.graph
    for node in [n for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")]:
        value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")),
                     None)
        if value is None or len(node.output) != 1:
            continue
        value.name = node.output[0]
        graph.initializer.append(value)
        graph.node.remove(node)
    _shared_initializers_copied(graph)


def _shared_initializers_copied(graph: Any) -> None:
    """An ``Identity`` of an initializer, as an initializer of its own: torch.onnx.export
    writes equal tensors (a fresh model's zero biases) once and points at it through
    Identity nodes, and onnx2torch's converters look their weights up among the
    initializers only."""
    from onnx import TensorProto

    stored = {t.name: t for t in graph.initializer}
    for node in [n for n in graph.node if n.op_type == "Identity" and n.domain in ("", "ai.onnx")
                 and len(n.input) == 1 and n.input[0] in stored and len(n.output) == 1]:
        copy = TensorProto()
        copy.CopyFrom(stored[node.input[0]])
        copy.name = node.output[0]
        graph.initializer.append(copy)
        graph.node.remove(node)


def _initializers(proto: Any) -> list[Any]:
    return [*proto.graph.initializer,
            *(t for node in proto.graph.node for a in node.attribute for t in [a.t]
              if a.HasField("t"))]


class _Logits(nn.Module):
    """A transformers classifier answering plain logits, as every other format does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.inner(pixel_values=pixels).logits
        return logits


def _transformers(folder: Path, path: Path, described: ModelDescription) -> nn.Module:
    from transformers import AutoModelForImageClassification
    from transformers.utils import logging as transformers_logging

    # No progress bar per load in the server's log (and the trial's stderr).
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    inner = AutoModelForImageClassification.from_pretrained(
        str(folder), local_files_only=True, use_safetensors=True, trust_remote_code=False)
    return _Logits(inner)


BUILDERS: dict[str, Callable[[Path, Path, ModelDescription], nn.Module]] = {
    "timm": _timm, "timm-hf": _timm, "torchvision": _torchvision,
    "torchscript": _torchscript, "export": _export, "onnx": _onnx,
    "transformers": _transformers,
}
