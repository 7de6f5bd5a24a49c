"""The installer's logic on a small bundle, under wine: parts, upgrade, autostart,
keep/remove user data, a missing part. Seconds, not minutes; test_packaging.py does
the same on the real multi-GB bundle."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import ROOT
from wine import RUN_KEY, UNINSTALL_KEY, WinePrefix, tools_missing, verify_checksums

pytestmark = [pytest.mark.wine,
              pytest.mark.skipif(tools_missing() is not None, reason=str(tools_missing()))]

VERSION = __import__("app").__version__
PART_BYTES = 700_000


def build_installer(bundle: Path, out: Path, *extra: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "installer/build_installer.py", "--bundle",
                           str(bundle), "--out", str(out), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "installer-report.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> Path:
    """The shape of a real bundle (two executables, _internal/...), 2.4 MB of random
    bytes, one name with a $ in it (NSIS expands $ in strings)."""
    import random

    bundle = tmp_path_factory.mktemp("small") / "vramguard"
    rng = random.Random(7)
    for relative, size in [("vramguard", 300_000), ("vramguard-desktop", 300_000),
                           ("_internal/torch/lib/libtorch$cpu.so", 500_000),
                           ("_internal/torch/lib/libc10.so", 500_000),
                           ("_internal/nvidia/cu13/lib/libcudart.so.13", 600_000),
                           ("_internal/app/ui/dashboard.html", 2_000)]:
        path = bundle / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    return bundle


def program_icon(path: Path) -> Path:
    """The icon build.py gives the bundle (NSIS is picky about .ico formats)."""
    spec = importlib.util.spec_from_file_location("build", ROOT / "packaging" / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.write_icon(path)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def small_installer(small_bundle, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("installer")
    icon = program_icon(out.parent / "vramguard.ico")
    report = build_installer(small_bundle, out, "--compressor", "zlib",
                             "--part-size", str(PART_BYTES), "--icon", str(icon))
    assert len(report["parts"]) >= 3  # type: ignore[arg-type]
    assert all(part["bytes"] <= PART_BYTES for part in report["parts"])  # type: ignore[union-attr]
    return out


@pytest.fixture
def wine(tmp_path) -> Iterator[WinePrefix]:
    """A fresh wine prefix (about 700 MB), deleted afterwards."""
    prefix = WinePrefix(tmp_path / "prefix")
    try:
        yield prefix
    finally:
        shutil.rmtree(prefix.folder, ignore_errors=True)


def test_install_upgrade_autostart_and_uninstall(small_installer, wine):
    setup = small_installer / f"vramguard-{VERSION}-setup.exe"
    sums = small_installer / f"vramguard-{VERSION}-files.sha256"

    assert wine.run(setup, "/S") == 0
    assert verify_checksums(wine.install_dir, sums) == 6
    assert wine.shortcut.is_file()
    entry = wine.registry(UNINSTALL_KEY)
    assert entry is not None and entry["DisplayVersion"] == VERSION
    assert entry["InstallLocation"].endswith(r"AppData\Local\Programs\vramguard")
    assert entry["QuietUninstallString"].endswith(r'uninstall.exe" /S')
    assert "vramguard" not in (wine.registry(RUN_KEY) or {})  # start at login is opt-in

    # The user's data, and a file that is not ours, in the install folder.
    (wine.data_dir / "Logs").mkdir(parents=True)
    (wine.data_dir / "Logs" / "vramguard.log").write_text("kept across upgrades")
    (wine.install_dir / "notes.txt").write_text("the user's, not the installer's")

    assert wine.run(setup, "/S", "/AUTOSTART") == 0  # upgrade in place, asking for autostart
    verify_checksums(wine.install_dir, sums)
    assert (wine.data_dir / "Logs" / "vramguard.log").is_file()
    run = wine.registry(RUN_KEY) or {}
    assert run.get("vramguard", "").endswith(r'Programs\vramguard\vramguard-desktop"')

    assert wine.run(wine.install_dir / "uninstall.exe", "/S", "/REMOVEDATA") == 0
    left = sorted(p.relative_to(wine.install_dir).as_posix()
                  for p in wine.install_dir.rglob("*"))
    assert left == ["notes.txt"]  # everything it installed, and nothing else
    assert not wine.shortcut.exists() and not wine.data_dir.exists()
    assert wine.registry(UNINSTALL_KEY) is None
    assert "vramguard" not in (wine.registry(RUN_KEY) or {})


def test_uninstall_keeps_user_data_unless_asked(small_installer, wine):
    assert wine.run(small_installer / f"vramguard-{VERSION}-setup.exe", "/S") == 0
    (wine.data_dir).mkdir(parents=True)
    (wine.data_dir / "config.toml").write_text("port = 9000\n")
    assert wine.run(wine.install_dir / "uninstall.exe", "/S") == 0
    assert not wine.install_dir.exists()
    assert (wine.data_dir / "config.toml").read_text() == "port = 9000\n"


def test_a_missing_part_stops_the_setup_and_leaves_nothing(small_installer, wine, tmp_path):
    lonely = tmp_path / "download"
    lonely.mkdir()
    setup = small_installer / f"vramguard-{VERSION}-setup.exe"
    (lonely / setup.name).write_bytes(setup.read_bytes())  # the parts were not copied
    assert wine.run(lonely / setup.name, "/S") != 0
    assert not wine.install_dir.exists() or not any(wine.install_dir.rglob("*.so*"))
    assert wine.registry(UNINSTALL_KEY) is None and not wine.shortcut.exists()


def test_a_part_run_by_hand_installs_nothing(small_installer, wine):
    part = small_installer / f"vramguard-{VERSION}-setup.part2.exe"
    # Without /FROMSETUP a part explains itself (a message box; /S answers it) and stops.
    wine.run(part, "/S")
    assert not wine.install_dir.exists()


def test_a_file_larger_than_a_part_is_refused_with_a_reason(small_bundle, tmp_path):
    done = subprocess.run([sys.executable, "installer/build_installer.py", "--bundle",
                           str(small_bundle), "--out", str(tmp_path), "--part-size",
                           "400000"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1
    assert "is larger than a part" in done.stderr and "--part-size" in done.stderr
