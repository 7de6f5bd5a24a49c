"""Run the Windows installer under wine in a fresh prefix, and read what it left.

Files are checked on disk and registry values in the prefix's user.reg, never only
by exit codes (an installer that cannot run under wine may still exit 0).
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

UNINSTALL_KEY = r"Software\Microsoft\Windows\CurrentVersion\Uninstall\vramguard"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"


def makensis_missing() -> str | None:
    if shutil.which("makensis") is None:
        return "makensis is not installed (apt-get install nsis)"
    return None


def tools_missing() -> str | None:
    """Why the wine tests cannot run here (.ci/run installs nsis, wine, wine64 and wine32)."""
    for tool in ("makensis", "wine", "wineserver"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install nsis wine wine64)"
    # The installer is a 32-bit program (stock NSIS builds no other kind). Debian's wine
    # runs it only with wine32, and says so unless WINEDEBUG silences it.
    env = {key: value for key, value in os.environ.items() if key != "WINEDEBUG"}
    hint = subprocess.run(["wine", "--version"], env=env, capture_output=True, text=True,
                          timeout=60)
    if "wine32 is missing" in hint.stdout + hint.stderr:
        return ("wine32 is not installed (dpkg --add-architecture i386; apt-get update; "
                "apt-get install wine32:i386)")
    return None


def stock_nsis(folder: Path) -> Path:
    """A copy of makensis's data folder stripped to what the official Windows NSIS ships:
    x86 stubs and plugins only (Debian's package adds amd64 ones, which once let a script
    that stock NSIS refuses compile here). Point makensis at it with NSISDIR."""
    info = subprocess.run(["makensis", "-HDRINFO"], capture_output=True, text=True,
                          check=True).stdout
    found = re.search(r"\bNSISDIR=([^,\n]+)", info)
    assert found is not None, "makensis -HDRINFO names no NSISDIR"
    shutil.copytree(found.group(1).strip(), folder)
    for stub in (folder / "Stubs").glob("*amd64*"):
        stub.unlink()
    shutil.rmtree(folder / "Plugins" / "amd64-unicode", ignore_errors=True)
    for tool in (folder / "Bin").glob("*amd64*"):
        tool.unlink()
    assert not list(folder.rglob("*amd64*")), "stripping missed an amd64 file"
    return folder


def compile_nsis(script: str, out: Path, nsis_dir: Path) -> Path:
    """A small Windows program written in NSIS (makensis is the only Windows compiler
    here): the tests' stand-ins for vramguard's executables."""
    source = out.with_suffix(".nsi")
    source.write_text(f'Unicode true\nOutFile "{out}"\n{script}')
    done = subprocess.run(["makensis", "-V2", str(source)], capture_output=True, text=True,
                          env={**os.environ, "NSISDIR": str(nsis_dir)})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def pe_machine(program: Path) -> str:
    """The CPU a Windows program is built for, from its PE header."""
    data = program.read_bytes()[:4096]
    header = int.from_bytes(data[0x3C:0x40], "little")
    assert data[header:header + 4] == b"PE\0\0", f"{program} is not a Windows program"
    machine = int.from_bytes(data[header + 4:header + 6], "little")
    return {0x14C: "x86", 0x8664: "amd64"}.get(machine, hex(machine))


class WinePrefix:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = {**os.environ, "WINEPREFIX": str(folder), "WINEDEBUG": "-all",
                    # no Mono/Gecko prompts, no menu entries written into the real $HOME
                    "WINEDLLOVERRIDES": "mscoree,mshtml=;winemenubuilder.exe=d"}
        user = self.folder / "drive_c" / "users" / getpass.getuser()
        self.local_appdata = user / "AppData" / "Local"
        self.install_dir = self.local_appdata / "Programs" / "vramguard"
        self.data_dir = self.local_appdata / "vramguard"
        self.shortcut = (user / "AppData" / "Roaming" / "Microsoft" / "Windows" / "Start Menu"
                         / "Programs" / "vramguard.lnk")

    def run(self, program: Path, *args: str, timeout: float = 1800, settle: bool = True) -> int:
        """Run a Windows program; with `settle`, also wait until every process of the prefix
        has ended (an NSIS uninstaller re-launches itself from a temporary copy)."""
        done = subprocess.run(["wine", str(program), *args], env=self.env, timeout=timeout,
                              capture_output=True)
        if settle:
            self.settle(timeout)
        return done.returncode

    def create(self) -> None:
        """Make the prefix now: two programs started at once into a prefix that does not
        exist yet race to create it, and one of them fails."""
        subprocess.run(["wineboot", "--init"], env=self.env, timeout=600, check=True,
                       capture_output=True)
        self.settle()

    def start(self, program: Path, *args: str) -> subprocess.Popen[bytes]:
        """Start a Windows program and leave it running."""
        return subprocess.Popen(["wine", str(program), *args], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def settle(self, timeout: float = 1800) -> None:
        """Wait until every process of the prefix has ended (the registry is written to
        user.reg then)."""
        subprocess.run(["wineserver", "-w"], env=self.env, timeout=timeout, check=True)

    def kill(self) -> None:
        subprocess.run(["wineserver", "-k"], env=self.env, timeout=60, check=False)

    def registry(self, key: str) -> dict[str, str] | None:
        """The values of an HKCU key as written in user.reg, or None if there is no key."""
        text = (self.folder / "user.reg").read_text(encoding="utf-8", errors="replace")
        header = "[" + key.replace("\\", "\\\\") + "]"
        start = text.find(header + " ")
        if start < 0:
            return None
        body = text[start:].split("\n\n", 1)[0]
        values = {}
        for name, value in re.findall(r'^"((?:[^"\\]|\\.)*)"=(.*)$', body, re.M):
            if value.startswith('"') and value.endswith('"'):  # a string; else dword:...
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            values[name] = value
        return values


@contextmanager
def virtual_display() -> Iterator[str]:
    """An Xvfb display for the installer's own window (silent installs need none)."""
    read, write = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "1024x768x24",
                             "-nolisten", "tcp"], pass_fds=(write,),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    try:
        with os.fdopen(read) as numbers:
            number = numbers.readline().strip()
        assert number, "Xvfb did not start"
        yield f":{number}"
    finally:
        xvfb.terminate()
        xvfb.wait(timeout=30)


def sha256(path: Path) -> str:
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def verify_checksums(install_dir: Path, manifest: Path) -> int:
    """Every file of the manifest is installed with the same content; returns the count."""
    lines = manifest.read_text().splitlines()
    for line in lines:
        expected, relative = line.split("  ", 1)
        assert sha256(install_dir / relative) == expected, f"wrong content: {relative}"
    return len(lines)
