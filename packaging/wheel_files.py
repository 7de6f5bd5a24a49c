"""Summarise what Windows torch wheels contain, for tests that cannot download them.

    pip download --platform win_amd64 --python-version 3.11 --only-binary=:all: \
        --no-deps torch==2.14.1 torchvision==0.29.1 -d WHEELS
    python packaging/wheel_files.py WHEELS/*.whl > tests/data/windows-cpu-wheels.json

Keeps, with their sizes, every native file (.dll, .pyd, .exe), the largest files and the
longest paths: what the manifest, the installer's part size and Windows' path limit are
checked against (tests/unit/packaging/test_bundle_manifest.py). Run it again after
changing the torch pins, or on the cu130 wheels from a machine that can reach PyTorch's
index.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zipfile
from pathlib import Path

NATIVE = (".dll", ".pyd", ".exe")
KEEP = 10


def summary(wheels: list[Path]) -> dict[str, object]:
    files: dict[str, int] = {}
    described = []
    for wheel in sorted(wheels):
        with zipfile.ZipFile(wheel) as archive:
            entries = [entry for entry in archive.infolist() if not entry.is_dir()]
        files.update((entry.filename, entry.file_size) for entry in entries)
        described.append({"name": wheel.name, "bytes": wheel.stat().st_size,
                          "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                          "files": len(entries),
                          "unpacked_bytes": sum(entry.file_size for entry in entries)})

    def pick(paths: list[str]) -> dict[str, int]:
        return {path: files[path] for path in paths}

    return {
        "wheels": described,
        "native": pick(sorted(path for path in files if path.lower().endswith(NATIVE))),
        "largest": pick(sorted(files, key=lambda path: (-files[path], path))[:KEEP]),
        "longest": pick(sorted(files, key=lambda path: (-len(path), path))[:KEEP]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path, nargs="+")
    args = parser.parse_args(argv)
    json.dump(summary(args.wheels), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
