"""Build the vramguard bundle with PyInstaller, check it, and say how big it is.

    python -m packaging.build [--dist DIR] [--work DIR] [--cpu-only]

All build logic lives here so that build.ps1 (Windows) stays a thin wrapper. After
PyInstaller, the bundle is checked against packaging/manifest.toml (the libraries that
stock hooks miss, the model weights, the dashboard): a bundle that lacks any of them,
a CPU-only bundle that carries CUDA libraries, one that carries the cluster extra (Ray,
Redis: manifest.toml's [never]), or a path Windows could not open once installed fails
the build instead of failing on a user's computer. Before building, the torch in this
Python must be the flavour asked for (CUDA, or CPU with --cpu-only). A report (build
time, size by component, file count) is written beside the bundle as bundle-report.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path, PurePath

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "packaging" / "vramguard.spec"
MANIFEST = ROOT / "packaging" / "manifest.toml"
NAME = "vramguard"
ICON_SIZES = [(16, 16), (24, 24), (32, 32), (48, 48), (64, 64), (256, 256)]
# The per-user install folder for a long profile name (a 20-character account name and
# a domain suffix). Windows opens no longer path (MAX_PATH: 260 with the final NUL)
# unless long paths were switched on, which an installer cannot count on.
INSTALL_FOLDER = "C:\\Users\\" + "u" * 36 + "\\AppData\\Local\\Programs\\vramguard"
MAX_PATH = 259


def platform_key() -> str:
    return "windows" if sys.platform == "win32" else "linux"


def write_icon(path: Path) -> Path:
    """The program icon is the tray gauge itself (a healthy, part-used budget)."""
    from tray.icon import Gauge, draw_icon

    image = draw_icon(Gauge(used=0.45, peak=0.6, low=0.75, high=0.9, state="ok"), 256)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, sizes=ICON_SIZES)
    return path


def write_version_file(path: Path, version: str) -> Path:
    """Windows file properties (Explorer > Properties > Details) in PyInstaller's format."""
    numbers = (*(int(part) for part in version.split(".")[:3]), 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""VSVersionInfo(
  ffi=FixedFileInfo(filevers={numbers}, prodvers={numbers}, mask=0x3f, flags=0x0,
                    OS=0x40004, fileType=0x1, subtype=0x0, date=(0, 0)),
  kids=[
    StringFileInfo([StringTable('040904B0', [
      StringStruct('CompanyName', 'vramguard'),
      StringStruct('FileDescription', 'vramguard local image classification'),
      StringStruct('FileVersion', '{version}'),
      StringStruct('InternalName', 'vramguard'),
      StringStruct('OriginalFilename', 'vramguard.exe'),
      StringStruct('ProductName', 'vramguard'),
      StringStruct('ProductVersion', '{version}')])]),
    VarFileInfo([VarStruct('Translation', [1033, 1200])])
  ]
)
""", encoding="utf-8")
    return path


def manifest() -> dict[str, list[str]]:
    return tomllib.loads(MANIFEST.read_text(encoding="utf-8"))[platform_key()]


def required_entries(cpu_only: bool) -> list[str]:
    entries = manifest()
    return entries["core"] + ([] if cpu_only else entries["cuda"])


def never_bundled() -> list[str]:
    """Modules no bundle may carry (manifest.toml's [never]: the cluster extra)."""
    modules: list[str] = tomllib.loads(MANIFEST.read_text(encoding="utf-8"))["never"][
        "modules"]
    return modules


def executables(bundle: Path) -> list[Path]:
    suffix = ".exe" if platform_key() == "windows" else ""
    return [bundle / f"{NAME}{suffix}", bundle / f"{NAME}-desktop{suffix}"]


def bundled_modules(bundle: Path) -> tuple[set[str], list[str]]:
    """The Python modules in the executables' archives (pure Python lives there, not in
    files), and the executables that are not PyInstaller programs. A missing one is left
    to the manifest check."""
    from PyInstaller.archive.readers import pkg_archive_contents
    from PyInstaller.loader.pyimod01_archive import ArchiveReadError

    modules: set[str] = set()
    unreadable = []
    for program in executables(bundle):
        if program.is_file():
            try:
                modules.update(pkg_archive_contents(str(program)))
            except ArchiveReadError:
                unreadable.append(program.name)
    return modules, unreadable


def carried(bundle: Path, modules: set[str], names: list[str]) -> list[str]:
    """Which of ``names`` the bundle carries: as a module (or one inside it) in ``modules``,
    or as files under _internal/ (extension modules and data)."""
    return [name for name in names
            if any(module == name or module.startswith(name + ".") for module in modules)
            or (bundle / "_internal" / Path(*name.split("."))).exists()]


def present(bundle: Path, entry: str) -> bool:
    return any(path.is_file() for path in bundle.glob(entry))


def missing_entries(bundle: Path, entries: list[str]) -> list[str]:
    """Manifest entries that match no file in the bundle."""
    return [entry for entry in entries if not present(bundle, entry)]


def installed_path(relative: PurePath) -> str:
    """Where a bundle file lands on a user's computer (at its longest)."""
    return "\\".join((INSTALL_FOLDER, *relative.parts))


def torch_flavour_problem(cpu_only: bool) -> str | None:
    """Why this Python's torch is the wrong one for the bundle asked for. pip counts
    2.14.1+cpu as torch==2.14.1, so a build environment can hold either flavour."""
    import torch

    cuda = torch.version.cuda
    if cpu_only and cuda:
        return (f"this Python has torch {torch.__version__}, built for CUDA {cuda}, but a "
                "CPU-only bundle was asked for (--cpu-only): it would carry gigabytes of "
                "CUDA libraries it never uses. Build it with torch's CPU build (build.ps1 "
                "-Cpu makes its own environment for that), or leave out --cpu-only.")
    if not cpu_only and not cuda:
        return (f"this Python has torch {torch.__version__}, which cannot use the GPU, but a "
                "GPU bundle was asked for. Install torch's CUDA build (build.ps1 without "
                "-Cpu does), or add --cpu-only for a CPU-only bundle.")
    return None


def component_of(relative: Path) -> str:
    """Group a bundle file for the size report: nvidia/cu13, torch, torchvision, ..."""
    parts = relative.parts
    if parts[0] != "_internal" or len(parts) == 2:
        return "executables, Python and loose libraries"
    if parts[1] == "nvidia" and len(parts) > 3:
        return f"nvidia/{parts[2]}"
    if parts[1] == "torch" and len(parts) > 3 and parts[2] == "lib":
        return "torch/lib"
    return parts[1]


def size_report(bundle: Path) -> tuple[dict[str, int], int, int, Path]:
    """Bytes by component (largest first), file count, link count and the longest path,
    in one walk."""
    sizes: Counter[str] = Counter()
    files = links = 0
    longest = Path()
    for path in bundle.rglob("*"):
        if path.is_symlink():
            links += 1
        elif path.is_file():
            files += 1
            relative = path.relative_to(bundle)
            sizes[component_of(relative)] += path.stat().st_size
            if len(str(relative)) > len(str(longest)):
                longest = relative
    return dict(sizes.most_common()), files, links, longest


def run_pyinstaller(dist: Path, work: Path) -> None:
    from app import __version__

    icon = write_icon(work / "vramguard.ico")
    version_file = write_version_file(work / "version_info.txt", __version__)
    subprocess.run([sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                    "--distpath", str(dist), "--workpath", str(work), str(SPEC), "--",
                    "--icon", str(icon), "--version-file", str(version_file)],
                   cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "pyinstaller")
    parser.add_argument("--cpu-only", action="store_true",
                        help="torch without CUDA (Windows CPU wheels): the CUDA libraries "
                        "are not required, and not allowed")
    parser.add_argument("--verify-only", action="store_true",
                        help="check an existing bundle against the manifest, do not build")
    args = parser.parse_args(argv)
    bundle = args.dist / NAME

    started = time.monotonic()
    if not args.verify_only:
        problem = torch_flavour_problem(args.cpu_only)
        if problem:
            print(f"build.py: {problem}", file=sys.stderr)
            return 1
        run_pyinstaller(args.dist, args.work)
    build_s = time.monotonic() - started

    problems = [f"missing: {entry}"
                for entry in missing_entries(bundle, required_entries(args.cpu_only))]
    if args.cpu_only:
        unwanted = [entry for entry in manifest()["cuda"] if present(bundle, entry)]
        problems += [f"CUDA library in a CPU-only bundle: {entry}" for entry in unwanted]
        if unwanted:
            problems.append("(a CPU-only bundle must be built with torch's CPU build: "
                            "build.ps1 -Cpu makes its own environment for it)")
    modules, unreadable = bundled_modules(bundle)
    problems += [f"not a PyInstaller program: {name}" for name in unreadable]
    cluster = carried(bundle, modules, never_bundled())
    if cluster:
        problems.append(f"the cluster extra in the appliance's bundle: {', '.join(cluster)} "
                        "(manifest.toml's [never]; the spec's excludes should keep it out)")
    sizes, files, links, longest = size_report(bundle)
    if len(installed_path(longest)) > MAX_PATH:
        problems.append(f"path too long for Windows: {longest} ({len(installed_path(longest))}"
                        f" characters once installed, at most {MAX_PATH})")
    if problems:
        print(f"build.py: the bundle {bundle} cannot be shipped as it is:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    report = {"bundle": str(bundle), "platform": platform_key(), "cpu_only": args.cpu_only,
              "build_seconds": None if args.verify_only else round(build_s, 1),
              "total_bytes": sum(sizes.values()), "files": files, "symlinks": links,
              "longest_path": str(longest),
              "longest_installed_path_chars": len(installed_path(longest)),
              "bytes_by_component": sizes}
    (args.dist / "bundle-report.json").write_text(json.dumps(report, indent=2),
                                                  encoding="utf-8")
    print(f"bundle: {bundle}  ({report['total_bytes'] / 1024**3:.2f} GiB in {files} files, "
          f"{links} symbolic links"
          + ("" if args.verify_only else f", built in {build_s:.0f} s") + ")")
    for component, size in list(sizes.items())[:12]:
        print(f"  {size / 1024**2:9.0f} MiB  {component}")
    print("manifest: all required files present")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
