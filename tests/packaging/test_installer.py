"""The installer's logic on a small bundle, under wine: parts, upgrade, autostart,
keep/remove user data, a missing part, a vramguard that will not stop. Seconds, not
minutes; test_packaging.py does the same on the real multi-GB bundle.

Everything here is compiled with makensis pointed at an NSIS folder stripped to what the
official Windows NSIS ships (x86 stubs and plugins only): the NSIS that build.ps1 and the
Windows workflow use."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from live_server import ROOT
from wine import (
    RUN_KEY,
    UNINSTALL_KEY,
    WinePrefix,
    compile_nsis,
    makensis_missing,
    pe_machine,
    stock_nsis,
    tools_missing,
    verify_checksums,
    virtual_display,
)

pytestmark = pytest.mark.skipif(makensis_missing() is not None, reason=str(makensis_missing()))
WINE_MISSING = tools_missing()


def needs_wine(test: Callable[..., None]) -> Callable[..., None]:
    """A test that runs the installer under wine (the others need makensis alone)."""
    for mark in (pytest.mark.wine,
                 pytest.mark.skipif(WINE_MISSING is not None, reason=str(WINE_MISSING))):
        test = mark(test)
    return test


VERSION = __import__("app").__version__
PART_BYTES = 700_000
PROGRESS_END = 30000  # NSIS's progress bar runs from 0 to 30000


@pytest.fixture(scope="module")
def nsis_dir(tmp_path_factory) -> Path:
    return stock_nsis(tmp_path_factory.mktemp("stock-nsis") / "nsis")


def build_installer(bundle: Path, out: Path, nsis_dir: Path, *extra: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "installer/build_installer.py", "--bundle",
                           str(bundle), "--out", str(out), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "NSISDIR": str(nsis_dir)})
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
def small_installer(small_bundle, nsis_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("installer")
    icon = program_icon(out.parent / "vramguard.ico")
    report = build_installer(small_bundle, out, nsis_dir, "--compressor", "zlib",
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
        prefix.kill()
        shutil.rmtree(prefix.folder, ignore_errors=True)


def test_the_installer_builds_with_the_nsis_windows_users_have(small_installer):
    """Stock NSIS for Windows has only x86 stubs: `Target amd64-unicode` fails there with
    "Unable to set target architecture". The installer and its parts are 32-bit programs."""
    programs = sorted([*small_installer.glob("vramguard-*-setup*.exe"),
                       *small_installer.glob("vramguard-*-setup.part*.bin")])
    assert len(programs) >= 3
    assert {program.name: pe_machine(program) for program in programs} == {
        program.name: "x86" for program in programs}


def test_one_download_is_a_program_the_parts_are_named_as_data(small_installer):
    """Issue 27, item 9: browsers and SmartScreen warn about each downloaded program (by
    its type), so only the setup is one; the parts are .bin, which the setup starts."""
    downloads = sorted(path.name for path in small_installer.iterdir()
                       if path.name.startswith("vramguard-") and "-files." not in path.name)
    assert [name for name in downloads if name.endswith(".exe")] == [
        f"vramguard-{VERSION}-setup.exe"]
    parts = [name for name in downloads if name != f"vramguard-{VERSION}-setup.exe"]
    assert len(parts) >= 2 and all(re.fullmatch(
        rf"vramguard-{re.escape(VERSION)}-setup\.part\d+\.bin", name) for name in parts)


def part_lists(small_installer: Path) -> list[Path]:
    """The generated file lists of the setup's own part and of each other part, in order."""
    gen = small_installer / "nsis"
    parts = sorted(gen.glob("part*/part-files.nsh"), key=lambda path: int(path.parent.name[4:]))
    return [gen / "core-files.nsh", *parts]


def test_the_file_lists_move_the_progress_bar_by_bytes(small_installer):
    """NSIS moves its bar by instructions run, so it stood still while a part installed
    (one ExecWait) and raced through thousands of small files. The generated file lists
    move it by bytes instead: the setup through its own files, then each part, given the
    bar's window, through its files."""
    steps = [re.findall(r"!insertmacro Progress (\d+)", path.read_text())
             for path in part_lists(small_installer)]
    assert len(steps) >= 3 and all(steps)  # every part moves the bar
    positions = [int(position) for part in steps for position in part]
    assert positions == sorted(positions) and positions[-1] == PROGRESS_END
    assert "/PROGRESSBAR=$ProgressBar" in (ROOT / "installer" / "vramguard.nsi").read_text()
    # NSIS would set the bar after each instruction of a section: the setup's section
    # only calls the function that does the work, so the bar is the file lists' alone.
    section = re.search(r'^Section "vramguard \(required\)" SecCore\n(.*?)^SectionEnd',
                        (ROOT / "installer" / "vramguard.nsi").read_text(), re.M | re.S)
    assert section is not None
    code = [line.split(";")[0].strip() for line in section.group(1).splitlines()]
    assert [line for line in code if line and not line.startswith(("SectionIn", "AddSize"))] \
        == ["Call Install"]


@needs_wine
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


@needs_wine
def test_uninstall_keeps_user_data_unless_asked(small_installer, wine):
    assert wine.run(small_installer / f"vramguard-{VERSION}-setup.exe", "/S") == 0
    (wine.data_dir).mkdir(parents=True)
    (wine.data_dir / "config.toml").write_text("port = 9000\n")
    assert wine.run(wine.install_dir / "uninstall.exe", "/S") == 0
    assert not wine.install_dir.exists()
    assert (wine.data_dir / "config.toml").read_text() == "port = 9000\n"


@needs_wine
def test_a_missing_part_stops_the_setup_and_leaves_nothing(small_installer, wine, tmp_path):
    lonely = tmp_path / "download"
    lonely.mkdir()
    setup = small_installer / f"vramguard-{VERSION}-setup.exe"
    (lonely / setup.name).write_bytes(setup.read_bytes())  # the parts were not copied
    assert wine.run(lonely / setup.name, "/S") != 0
    assert not wine.install_dir.exists() or not any(wine.install_dir.rglob("*.so*"))
    assert wine.registry(UNINSTALL_KEY) is None and not wine.shortcut.exists()


@needs_wine
def test_a_part_run_by_hand_installs_nothing(small_installer, wine):
    part = small_installer / f"vramguard-{VERSION}-setup.part2.bin"
    # Without /FROMSETUP a part explains itself (a message box; /S answers it) and stops.
    wine.run(part, "/S")
    assert not wine.install_dir.exists()


def test_a_file_larger_than_a_part_is_refused_with_a_reason(small_bundle, tmp_path):
    done = subprocess.run([sys.executable, "installer/build_installer.py", "--bundle",
                           str(small_bundle), "--out", str(tmp_path), "--part-size",
                           "400000"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1
    assert "is larger than a part" in done.stderr and "--part-size" in done.stderr


@needs_wine
def test_an_upgrade_keeps_autostart_as_the_user_had_it(small_installer, wine):
    """The old uninstaller, which an upgrade runs first, deletes the Run value; the new
    setup reads it before that. /AUTOSTART and /NOAUTOSTART change it; neither keeps it."""
    setup = small_installer / f"vramguard-{VERSION}-setup.exe"

    def autostart() -> bool:
        return "vramguard" in (wine.registry(RUN_KEY) or {})

    seen = []
    for args in [(), (), ("/AUTOSTART",), (), ("/NOAUTOSTART",), ()]:
        assert wine.run(setup, "/S", *args) == 0
        seen.append(autostart())
    assert seen == [False, False, True, True, False, False]


# The console program's stand-in: `stop` fails as many times as stop-fails.txt beside it
# says, then succeeds; every call is written to stop-calls.txt ("<exit status> <args>").
FAKE_STOP = r"""
SilentInstall silent
RequestExecutionLevel user
!include FileFunc.nsh
!include LogicLib.nsh
Section
  StrCpy $1 0
  ClearErrors
  FileOpen $0 "$EXEDIR\stop-fails.txt" r
  ${IfNot} ${Errors}
    FileRead $0 $1
    FileClose $0
  ${EndIf}
  StrCpy $2 0
  ClearErrors
  FileOpen $0 "$EXEDIR\stop-calls.txt" r
  ${IfNot} ${Errors}
    ${Do}
      ClearErrors
      FileRead $0 $3
      ${IfThen} ${Errors} ${|} ${ExitDo} ${|}
      IntOp $2 $2 + 1
    ${Loop}
    FileClose $0
  ${EndIf}
  ${If} $2 < $1
    StrCpy $4 1
  ${Else}
    StrCpy $4 0
  ${EndIf}
  ${GetParameters} $5
  FileOpen $0 "$EXEDIR\stop-calls.txt" a
  FileSeek $0 0 END
  FileWrite $0 "$4 $5$\r$\n"
  FileClose $0
  SetErrorLevel $4
SectionEnd
"""

# A vramguard that will not stop, as far as the files go: loads the installed copy's
# torch DLL (it sits beside the install folder) and holds it, as a running vramguard holds
# torch's, until holder-quit.txt appears beside it (two minutes at most). Not the
# installed vramguard-desktop.exe itself: Windows lets a running program be renamed, but
# wine refuses, while for a loaded DLL both refuse the delete and allow the rename.
HOLDER = r"""
SilentInstall silent
RequestExecutionLevel user
!include LogicLib.nsh
Section
  System::Call 'kernel32::LoadLibraryW(w "$EXEDIR\vramguard\_internal\torch\lib\c10.dll") p .r0'
  FileOpen $1 "$EXEDIR\holder-ready.txt" w
  FileWrite $1 "$0"
  FileClose $1
  ${For} $2 1 600
    ${IfThen} ${FileExists} "$EXEDIR\holder-quit.txt" ${|} ${ExitFor} ${|}
    Sleep 200
  ${Next}
SectionEnd
"""


@pytest.fixture(scope="module")
def held_installer(nsis_dir, tmp_path_factory) -> Path:
    """An installer whose vramguard.exe is FAKE_STOP, whose c10.dll is a real 32-bit DLL,
    and HOLDER beside it."""
    bundle = tmp_path_factory.mktemp("held") / "vramguard"
    library = bundle / "_internal" / "torch" / "lib"
    library.mkdir(parents=True)
    (bundle / "_internal" / "app").mkdir()
    (bundle / "_internal" / "app" / "dashboard.html").write_text("<p>vramguard</p>")
    shutil.copy(nsis_dir / "Plugins" / "x86-unicode" / "nsExec.dll", library / "c10.dll")
    (bundle / "vramguard-desktop.exe").write_bytes(b"MZ not run here")
    compile_nsis(FAKE_STOP, bundle.parent / "vramguard.exe", nsis_dir).rename(
        bundle / "vramguard.exe")
    out = tmp_path_factory.mktemp("held-installer")
    build_installer(bundle, out, nsis_dir, "--compressor", "zlib")
    compile_nsis(HOLDER, out / "holder.exe", nsis_dir)
    return out


def wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


@needs_wine
def test_stop_is_retried_and_files_in_use_are_moved_aside(held_installer, wine):
    """`vramguard stop` exits 1 when a server did not stop: the setup asks again. A DLL
    still loaded cannot be deleted on Windows, and wine enforces the same rule, but it can
    be renamed: it goes to _pending-delete, its name is free for the new version, and the
    next install or uninstall deletes it. (Silent here: the message that tells the user
    is a message box that /S answers.)"""
    setup = held_installer / f"vramguard-{VERSION}-setup.exe"
    sums = held_installer / f"vramguard-{VERSION}-files.sha256"
    assert wine.run(setup, "/S") == 0
    install = wine.install_dir
    aside = install / "_pending-delete"

    (install / "stop-fails.txt").write_text("1")
    holder = shutil.copy(held_installer / "holder.exe", install.parent)
    wine.start(holder)
    wait_for(install.parent / "holder-ready.txt")
    assert (install.parent / "holder-ready.txt").read_text() not in ("", "0")  # DLL loaded
    assert wine.run(setup, "/S", settle=False) == 0  # the upgrade, while it is held

    # The setup asks, and asks again after the failure; then the old uninstaller asks.
    calls = (install / "stop-calls.txt").read_text().splitlines()
    assert calls == ["1 stop --timeout-s 30"] + ["0 stop --timeout-s 30"] * 2
    verify_checksums(install, sums)  # the new version is complete
    [set_aside] = aside.iterdir()
    assert set_aside.read_bytes() == (install / "_internal/torch/lib/c10.dll").read_bytes()

    (install.parent / "holder-quit.txt").write_text("")
    wine.settle()
    assert wine.run(setup, "/S") == 0  # the next install deletes what was set aside
    assert not aside.exists()
    assert wine.run(install / "uninstall.exe", "/S") == 0
    assert sorted(p.name for p in install.iterdir()) == ["stop-calls.txt", "stop-fails.txt"]


# Drives the setup's own window like a person (Next, Install) and writes down where its
# progress bar stands every 20 ms until it is full or the install page is gone.
PROGRESS_PROBE = r"""
SilentInstall silent
RequestExecutionLevel user
!include LogicLib.nsh
!include WinMessages.nsh
Section
  FileOpen $9 "$EXEDIR\progress.txt" w
  ; the setup's window: the dialog with a Back button (id 3)
  StrCpy $1 0
  ${For} $0 1 3000
    FindWindow $1 "#32770" "" 0 $1
    ${If} $1 = 0
      Sleep 100
    ${Else}
      GetDlgItem $2 $1 3
      ${IfThen} $2 <> 0 ${|} ${ExitFor} ${|}
    ${EndIf}
  ${Next}
  GetDlgItem $2 $1 1
  ${For} $0 1 2
    Sleep 1500
    SendMessage $2 ${BM_CLICK} 0 0 /TIMEOUT=5000
  ${Next}
  StrCpy $6 0
  ${For} $0 1 6000
    FindWindow $3 "#32770" "" $1
    GetDlgItem $4 $3 1004
    ${If} $4 = 0
      ${IfThen} $6 = 1 ${|} ${ExitFor} ${|}
    ${Else}
      StrCpy $6 1
      ClearErrors
      SendMessage $4 ${PBM_GETPOS} 0 0 $5 /TIMEOUT=5000
      ${IfNot} ${Errors}
        FileWrite $9 "$5$\r$\n"
        ${IfThen} $5 = 30000 ${|} ${ExitFor} ${|}
      ${EndIf}
    ${EndIf}
    Sleep 20
  ${Next}
  FileClose $9
SectionEnd
"""


@needs_wine
@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="Xvfb is not installed")
def test_the_progress_bar_moves_while_each_part_installs(small_installer, nsis_dir, wine,
                                                         tmp_path):
    """An interactive install on a virtual display. The end of each part but the last is
    a position only that part sets (its share of the bytes, not NSIS's instruction count),
    and the bar shows it while the next part starts: the part moved the setup's bar."""
    report = json.loads((small_installer / "installer-report.json").read_text())
    sizes = [part["bytes"] for part in report["parts"]]
    ends = [sum(sizes[:count]) * 1000 // sum(sizes) * PROGRESS_END // 1000
            for count in range(2, len(sizes))]
    probe = compile_nsis(PROGRESS_PROBE, tmp_path / "probe.exe", nsis_dir)
    wine.create()
    with virtual_display() as display:
        wine.env["DISPLAY"] = display
        wine.start(small_installer / f"vramguard-{VERSION}-setup.exe")
        wine.start(probe).wait(timeout=300)
        wine.kill()  # the finish page stays open
    seen = [int(line) for line in (tmp_path / "progress.txt").read_text().split()]
    assert seen and seen == sorted(seen), seen  # never backwards
    assert set(ends) <= set(seen), (ends, seen)
    assert seen[-1] == PROGRESS_END


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@needs_wine
def test_an_upgrade_keeps_an_older_versions_data_and_it_is_never_misread(
        small_installer, wine, tmp_path):
    """Issue 27, item 8: the data an older vramguard left in %LOCALAPPDATA%\\vramguard (a
    result pickled by diskcache's stock storage, as vramguards before the bytes-only
    cache wrote them, here saying the espresso is a teapot; a stored profile of an older
    format with absurd figures; the config and the token) comes through an upgrade byte
    for byte, and the new version reads none of it as its own: the espresso is an
    espresso again and the profile is measured again."""
    import diskcache
    from images import photo
    from live_server import live_server

    setup = small_installer / f"vramguard-{VERSION}-setup.exe"
    assert wine.run(setup, "/S") == 0
    data = wine.data_dir
    cache_dir, profile_dir = data / "Cache" / "results", data / "Cache" / "profiles"
    env = {"VRAMGUARD_CACHE_DIR": str(cache_dir), "VRAMGUARD_PROFILE_DIR": str(profile_dir)}
    jpeg = {"Content-Type": "image/jpeg"}
    with live_server(tmp_path, env=env) as server, server.client() as client:
        assert client.post("/v1/classify", content=photo(),
                           headers=jpeg).json()["predictions"][0]["label"] == "espresso"
    with diskcache.Cache(str(cache_dir)) as cache:  # the stock Disk: pickles the value
        [key] = list(cache.iterkeys())
        cache.set(key, {"predictions": [{"label": "teapot", "score": 1.0}]})
    [profile] = profile_dir.glob("*.json")
    stored = json.loads(profile.read_text())
    profile.write_text(json.dumps({**stored, "format": 0, "weights_bytes": 1}))
    (data / "config.toml").write_text("rate_limit = false\n")
    before = _snapshot(data)

    assert wine.run(setup, "/S") == 0  # the upgrade
    assert _snapshot(data) == before

    with live_server(tmp_path, env=env) as server, server.client() as client:
        answer = client.post("/v1/classify", content=photo(), headers=jpeg).json()
        assert answer["predictions"][0]["label"] == "espresso", answer
    assert json.loads(profile.read_text())["format"] != 0  # measured again, stored anew
