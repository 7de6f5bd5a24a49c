"""Compile the per-user Windows installer from a built bundle, split into parts.

    python -m installer.build_installer --bundle dist/vramguard --out dist/installer

NSIS cannot hold a payload much past 2 GB, and the bundle with torch's CUDA libraries
is about 4 GB. So the bundle is cut into parts of at most --part-size (uncompressed,
whole files): the first part goes into vramguard-<version>-setup.exe,
each other part into its own silent installer vramguard-<version>-setup.partN.bin that
the setup runs from its own folder. A part is named as data, not .exe: browsers and
SmartScreen judge a download by its type, so the person is warned once, about the setup,
not once per part; the setup starts each one itself (ExecWait: CreateProcess, which runs
a program whatever its name and asks SmartScreen nothing), and a double-click on a part
opens nothing. The uninstaller removes exactly the files of the
bundle (the list is generated here), never a whole folder the user picked.

Also written: vramguard-<version>-files.sha256, the checksum of every installed file
(what the install test verifies), and installer-report.json (sizes, compile time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
MAIN_SCRIPT = ROOT / "installer" / "vramguard.nsi"
PART_SCRIPT = ROOT / "installer" / "part.nsi"
DEFAULT_PART_BYTES = 1536 * 1024**2  # well under NSIS's 2 GB, even uncompressed
COMPRESSORS = ("lzma", "zlib", "bzip2", "none")
PROGRESS_END = 30000  # NSIS's progress bar runs from 0 to 30000
PROGRESS_STEPS = 1000


@dataclass
class Part:
    number: int
    files: list[PurePosixPath] = field(default_factory=list)
    size: int = 0


def bundle_files(bundle: Path) -> list[PurePosixPath]:
    """Every file of the bundle, relative, in a stable order."""
    return sorted(PurePosixPath(path.relative_to(bundle).as_posix())
                  for path in bundle.rglob("*") if path.is_file())


def split(bundle: Path, files: list[PurePosixPath], limit: int) -> list[Part]:
    """Whole files into as few parts of at most `limit` bytes as first-fit decreasing
    finds (fewer files to download); each part's files in path order."""
    sizes = {relative: (bundle / relative).stat().st_size for relative in files}
    parts: list[Part] = []
    for relative in sorted(files, key=lambda f: (-sizes[f], str(f))):
        size = sizes[relative]
        if size > limit:
            raise ValueError(f"{relative} alone ({size} bytes) is larger than a part "
                             f"({limit} bytes); raise --part-size (NSIS's limit is 2 GB)")
        part = next((p for p in parts if p.size + size <= limit), None)
        if part is None:
            part = Part(len(parts) + 1)
            parts.append(part)
        part.files.append(relative)
        part.size += size
    for part in parts:
        part.files.sort()
    return parts or [Part(1)]


def nsis_text(text: str) -> str:
    """NSIS expands $ in strings: a literal one is written $$."""
    return text.replace("$", "$$")


def windows(relative: PurePosixPath) -> str:
    return nsis_text(str(relative).replace("/", "\\"))


def file_commands(bundle: Path, files: list[PurePosixPath], done: int, total: int) -> str:
    """SetOutPath once per folder, one File command per file, and a Progress step each
    time another thousandth of the whole payload (`total` bytes, `done` of them installed
    before these files) is written. NSIS itself moves the bar by instructions run, which
    says nothing about bytes and nothing while a part installs."""
    lines, folder = [], None
    step = done * PROGRESS_STEPS // total
    for relative in files:
        if relative.parent != folder:
            folder = relative.parent
            target = "$INSTDIR" if str(folder) == "." else f"$INSTDIR\\{windows(folder)}"
            lines.append(f'  SetOutPath "{target}"')
        lines.append(f'  File "{bundle / relative}"')  # compile-time path: no $ expansion
        done += (bundle / relative).stat().st_size
        if done * PROGRESS_STEPS // total > step:
            step = done * PROGRESS_STEPS // total
            lines.append(f"  !insertmacro Progress {step * PROGRESS_END // PROGRESS_STEPS}")
    return "\n".join(lines) + "\n"


def remove_commands(files: list[PurePosixPath]) -> str:
    """Remove each file (RemoveFile moves one in use aside), then each folder deepest first
    (RMDir only removes empty ones)."""
    folders = {parent for relative in files for parent in relative.parents
               if str(parent) != "."}
    lines = [f'  !insertmacro RemoveFile "{windows(relative)}"' for relative in files]
    lines += [f'  RMDir "$INSTDIR\\{windows(folder)}"'
              for folder in sorted(folders, key=lambda f: (-len(f.parts), str(f)))]
    return "\n".join(lines) + "\n"


def human(size: int) -> str:
    return f"{size / 1024**3:.1f} GiB" if size >= 1024**3 else f"{size / 1024**2:.0f} MiB"


def part_name(version: str, number: int) -> str:
    return f"vramguard-{version}-setup.part{number}.bin"


def executable(bundle: Path, stem: str) -> str:
    """The bundle's executable names (.exe on Windows, none in the Linux twin)."""
    for name in (f"{stem}.exe", stem):
        if (bundle / name).is_file():
            return name
    raise FileNotFoundError(f"{bundle} has no {stem} executable: is it a vramguard bundle?")


def checksums(bundle: Path, files: list[PurePosixPath]) -> str:
    lines = []
    for relative in files:
        with (bundle / relative).open("rb") as stream:
            lines.append(f"{hashlib.file_digest(stream, 'sha256').hexdigest()}  {relative}")
    return "\n".join(lines) + "\n"


def compile_all(jobs: list[tuple[Path, dict[str, str]]], workers: int, logs: Path) -> None:
    """Run makensis for every script, `workers` at a time. The first failure stops the
    others at once: a part can take many minutes to compress."""
    pending, running = list(jobs), []
    try:
        while pending or running:
            while pending and len(running) < workers:
                script, defines = pending.pop(0)
                log = logs / f"makensis-{len(jobs) - len(pending)}.log"
                with log.open("w") as sink:
                    command = ["makensis", "-V2", "-NOCD",
                               *(f"-D{key}={value}" for key, value in defines.items()),
                               str(script)]
                    running.append((log, subprocess.Popen(command, stdout=sink,
                                                          stderr=subprocess.STDOUT)))
            for log, process in list(running):
                if process.poll() is None:
                    continue
                running.remove((log, process))
                if process.returncode != 0:
                    raise RuntimeError(f"makensis failed:\n{log.read_text(errors='replace')}")
            time.sleep(0.2)
    finally:
        for _, process in running:
            process.kill()
            process.wait()


def build(bundle: Path, out: Path, version: str, compressor: str, limit: int,
          icon: Path | None) -> dict[str, object]:
    if shutil.which("makensis") is None:
        raise RuntimeError("makensis not found: install NSIS (Debian: apt-get install nsis; "
                           "Windows: https://nsis.sourceforge.io)")
    files = bundle_files(bundle)
    parts = split(bundle, files, limit)
    total = sum(part.size for part in parts)
    payload = max(total, 1)  # the progress steps' denominator
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("vramguard-*-setup*.exe"), *out.glob("vramguard-*-setup*.bin")]:
        stale.unlink()  # an older build's parts would mislead
    gen = out / "nsis"
    shutil.rmtree(gen, ignore_errors=True)
    gen.mkdir()

    (gen / "core-files.nsh").write_text(file_commands(bundle, parts[0].files, 0, payload))
    (gen / "remove-files.nsh").write_text(remove_commands(files))
    (gen / "parts.nsh").write_text("".join(
        f'  !insertmacro InstallPart "{part_name(version, part.number)}" {part.number} '
        f'{len(parts)} "{human(part.size)}"\n' for part in parts[1:]))
    setup = out / f"vramguard-{version}-setup.exe"
    jobs: list[tuple[Path, dict[str, str]]] = [(MAIN_SCRIPT, {
        "VERSION": version, "OUTFILE": str(setup), "GEN": str(gen), "COMPRESSOR": compressor,
        "EXE_CONSOLE": executable(bundle, "vramguard"),
        # The Linux twin's programs are Linux programs: a 32-bit installer under wine
        # hangs trying to run one, so it does not ask the twin's console program to stop.
        **({"STOP_WITH_CONSOLE": "1"} if executable(bundle, "vramguard").endswith(".exe")
           else {}),
        "EXE_DESKTOP": executable(bundle, "vramguard-desktop"),
        "SIZE_KB": str(total // 1024), **({"ICON": str(icon)} if icon else {})})]
    for part in parts[1:]:
        part_gen = gen / f"part{part.number}"
        part_gen.mkdir()
        before = sum(earlier.size for earlier in parts[:part.number - 1])
        (part_gen / "part-files.nsh").write_text(
            file_commands(bundle, part.files, before, payload))
        jobs.append((PART_SCRIPT, {
            "VERSION": version, "PART": str(part.number), "GEN": str(part_gen),
            "COMPRESSOR": compressor,
            "OUTFILE": str(out / part_name(version, part.number))}))

    started = time.monotonic()
    compile_all(jobs, os.cpu_count() or 1, gen)
    compile_s = time.monotonic() - started
    (out / f"vramguard-{version}-files.sha256").write_text(checksums(bundle, files))

    outputs = [setup] + [out / part_name(version, part.number) for part in parts[1:]]
    report = {"version": version, "compressor": compressor, "compile_seconds":
              round(compile_s, 1), "payload_bytes": total, "files": len(files),
              "installers": {path.name: path.stat().st_size for path in outputs},
              "parts": [{"number": part.number, "files": len(part.files),
                         "bytes": part.size} for part in parts]}
    (out / "installer-report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    from app import __version__

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=ROOT / "dist" / "vramguard")
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "installer")
    parser.add_argument("--compressor", choices=COMPRESSORS, default="lzma",
                        help="lzma: smallest download, slowest to build (the release); "
                        "zlib: faster; none: no compression, fastest (the CI test)")
    parser.add_argument("--part-size", type=int, default=DEFAULT_PART_BYTES,
                        help="most bundle bytes per installer part")
    parser.add_argument("--icon", type=Path, help="installer icon (.ico)")
    args = parser.parse_args(argv)
    if args.icon is not None and not args.icon.is_file():
        print(f"build_installer: no icon at {args.icon}", file=sys.stderr)
        return 1
    if not (args.bundle / "_internal").is_dir():
        print(f"build_installer: no bundle at {args.bundle}: run packaging/build.py first",
              file=sys.stderr)
        return 1
    try:
        report = build(args.bundle, args.out, __version__, args.compressor, args.part_size,
                       args.icon)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"build_installer: {exc}", file=sys.stderr)
        return 1
    print(f"installer: {args.out} ({report['compressor']}, compiled in "
          f"{report['compile_seconds']} s)")
    for name, size in report["installers"].items():  # type: ignore[union-attr]
        print(f"  {size / 1024**2:9.0f} MiB  {name}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
