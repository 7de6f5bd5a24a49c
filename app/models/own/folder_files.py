"""Reading a model folder as the untrusted input it is.

A name from a manifest becomes a path only through ``inside``: never absolute, never
through ``..``, never a link that leads out of the folder. A weights file is checked
before anything parses it: not empty, not a pickle where safetensors should be, and a
safetensors header that fits in the file and whose tensors fit in what follows it (a
header that lies about its size would otherwise make the reader allocate what it
claims). ``torch.export`` archives may hold pickles that torch would unpickle with
``weights_only=False``; ``check_export_archive`` refuses those before torch opens it.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

from app.models.own.manifest import FolderError

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own reader refuses headers above this
PICKLE_PROTOCOL = 0x80  # the first byte of every pickle of protocol 2 and up
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive, TorchScript and .pt2 files
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8,
               "F8_E4M3": 1, "F8_E5M2": 1}
SAFE_CONVERSION = ("python -c \"import torch, safetensors.torch as s; "
                   "s.save_file(torch.load('pytorch_model.bin', weights_only=True), "
                   "'model.safetensors')\"")


def inside(folder: Path, name: str) -> Path:
    """``folder / name`` when that is a regular file inside ``folder``; else FolderError.

    Links are followed only to check where they lead: one that leads out is refused.
    """
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise FolderError(f"'{name}' must be a file name inside the model folder")
    path = folder / relative
    root = folder.resolve()
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise FolderError(f"The model folder has no file '{name}'") from None
    if not real.is_relative_to(root):
        raise FolderError(f"'{name}' is a link to a file outside the model folder; "
                          "copy the file into the folder instead")
    if not real.is_file():
        raise FolderError(f"'{name}' in the model folder is not a file")
    if real.stat().st_size == 0:
        raise FolderError(f"'{name}' is empty (0 bytes): the copy or download did not "
                          "finish")
    return path


def links_out(folder: Path) -> list[str]:
    """Every entry of ``folder`` (at any depth) that is a link leading outside it."""
    root = folder.resolve()
    found = []
    for base, dirs, files in os.walk(folder):
        for entry in (*dirs, *files):
            path = Path(base) / entry
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                found.append(str(path.relative_to(folder)))
    return sorted(found)


def is_pickle(path: Path) -> bool:
    """Whether ``path`` starts the way a pickle or a ``torch.save`` archive does."""
    with path.open("rb") as handle:
        head = handle.read(4)
    return head == ZIP_MAGIC or (len(head) > 0 and head[0] == PICKLE_PROTOCOL)


def check_safetensors(path: Path) -> None:
    """Refuse a file that is not a whole, honest safetensors file, before it is read."""
    name = path.name
    size = path.stat().st_size
    if is_pickle(path):
        raise FolderError(f"'{name}' is a pickle (torch.save), not safetensors; vramguard "
                          f"never unpickles weights. Convert it: {SAFE_CONVERSION}")
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise FolderError(f"'{name}' is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise FolderError(f"'{name}' is damaged: its header claims {length} bytes, "
                              f"more than the file's {size}")
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise FolderError(f"'{name}' is damaged: its header is not JSON") from None
    if not isinstance(header, dict):
        raise FolderError(f"'{name}' is damaged: its header is not a table of tensors")
    _check_tensors(name, header, size - 8 - length)


def _check_tensors(name: str, header: dict[str, object], data_bytes: int) -> None:
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise FolderError(f"'{name}' is damaged: tensor '{key}' has no description")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get(
            "data_offsets")
        if (dtype not in DTYPE_BYTES or not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise FolderError(f"'{name}' is damaged: tensor '{key}' is described wrongly")
        begin, end = offsets
        count = 1
        for dim in shape:
            count *= dim
        if not 0 <= begin <= end <= data_bytes or end - begin != count * DTYPE_BYTES[
                str(dtype)]:
            raise FolderError(f"'{name}' is damaged: tensor '{key}' claims bytes the file "
                              f"does not have ({data_bytes} bytes of tensors)")


def check_export_archive(path: Path) -> None:
    """Refuse a ``.pt2`` archive whose loading would unpickle anything: pickled weights
    or constants, custom objects, or sample inputs that are not plain tensors."""
    name = path.name
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise FolderError(f"'{name}' is not a torch.export archive (.pt2)") from None
    with archive:
        for member in archive.namelist():
            parts = member.split("/")
            if len(parts) >= 3 and parts[-2] in ("weights", "constants") and (
                    member.endswith(".pt") or parts[-1].startswith(("custom_obj",
                                                                    "opaque_obj"))):
                raise FolderError(f"'{name}' holds Python objects ({parts[-1]}) that "
                                  "loading would unpickle; export the model again with "
                                  "plain tensors only")
            if member.endswith("_config.json") and parts[-2] in ("weights", "constants"):
                _refuse_pickled_payloads(name, archive.read(member))
            if member.endswith(".pt"):
                _plain_tensors_only(name, archive.read(member), parts[-1])


def _refuse_pickled_payloads(name: str, config: bytes) -> None:
    try:
        entries = json.loads(config).get("config", {})
    except (ValueError, AttributeError):
        raise FolderError(f"'{name}' is damaged: an index inside it is not JSON") from None
    if any(isinstance(e, dict) and e.get("use_pickle") for e in entries.values()):
        raise FolderError(f"'{name}' stores weights as pickles that loading would "
                          "unpickle; export the model again with torch.export.save")


def _plain_tensors_only(name: str, data: bytes, member: str) -> None:
    """torch would retry a failed safe load of these with ``weights_only=False``."""
    import io

    import torch

    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        raise FolderError(f"'{name}' holds {member}, which is not plain tensors; vramguard "
                          "does not unpickle it") from None
