"""`vramguard models add|list|remove`: the own models of the models folder.

``add`` checks a folder the way the server would before serving it (a trial load in a
separate process, one image through the whole path, the output against the labels) and
copies it in only when it passes; a running vramguard finds it within seconds, without a
restart. Nothing here talks to the server: the folder is the interface.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.config import Settings


def add_models_parser(commands: Any, common: Any) -> None:
    """The `models` command and its three sub-commands."""
    parser = commands.add_parser("models", help="Add, list or remove your own models.",
                                 description="Your own models: folders from timm, Hugging "
                                 "Face, torchvision, TorchScript, torch.export or ONNX (see "
                                 "\"Serve your own model\" in the README).")
    actions = parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="Check a model folder and copy it in.")
    add.add_argument("path", type=Path, metavar="PATH", help="The model folder.")
    add.add_argument("--name", help="The name to serve it as (default: the folder's name, "
                     "in lower case).")
    listing = actions.add_parser("list", help="Your models, and why any cannot be served.")
    remove = actions.add_parser("remove", help="Remove one of your models.")
    remove.add_argument("name", metavar="NAME", help="The name `models list` shows.")
    for sub in (add, listing, remove):
        common(sub)


def run_models(args: argparse.Namespace, settings: Settings) -> int:
    from app.models.own.manifest import FolderError
    from app.models.own.store import OwnModels
    from app.models.sources import is_builtin

    store = OwnModels(settings.models_dir, timeout_s=settings.model_check_timeout_s,
                      reserved=is_builtin)
    try:
        if args.action == "add":
            return _add(store, args.path, args.name)
        if args.action == "remove":
            store.remove(args.name)
            print(f"Removed {args.name}.")
            return 0
        return _list(store)
    except FolderError as exc:
        print(f"vramguard: {exc}", file=sys.stderr)
        return 1


def _add(store: Any, path: Path, name: str | None) -> int:
    print(f"Checking {path}: loading it in a separate process and running an image "
          "through it…", file=sys.stderr, flush=True)
    entry = store.add(path, name)
    described = entry.description
    what = (f"{len(described.labels)} labels" if described.labels
            else "image features")
    print(f"Added {entry.name}: {described.task}, {described.format}, {what}, "
          f"{described.preprocessing.crop}x{described.preprocessing.crop} pixels.")
    route = "embed" if described.task == "embed" else "classify"
    print(f"A running vramguard serves it now as --model {entry.name} "
          f"(/v1/{route}?model={entry.name}).")
    return 0


def _list(store: Any) -> int:
    entries = store.scan(force=True)
    if not entries:
        print(f"None of your models is in {store.root}. Add one with: vramguard models add PATH")
        return 0
    rows = [("NAME", "TASK", "FORMAT", "LABELS", "INPUT")]
    broken = []
    for entry in entries:
        described = entry.description
        if described is None:
            broken.append(entry)
            continue
        size = described.preprocessing.crop
        rows.append((entry.name, described.task, described.format,
                     str(len(described.labels)) if described.labels else "-",
                     f"{size}x{size}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths,
                                                                strict=True)).rstrip())
    for entry in broken:
        print(f"{entry.name}: cannot be served: {entry.error}")
    print(f"({store.root})")
    return 1 if broken else 0
