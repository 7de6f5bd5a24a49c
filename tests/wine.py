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
from pathlib import Path

UNINSTALL_KEY = r"Software\Microsoft\Windows\CurrentVersion\Uninstall\vramguard"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"


def tools_missing() -> str | None:
    """Why these tests cannot run here (.ci/run installs nsis, wine and wine64)."""
    for tool in ("makensis", "wine", "wineserver"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install nsis wine wine64)"
    return None


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

    def run(self, program: Path, *args: str, timeout: float = 1800) -> int:
        """Run a Windows program and wait until every process of the prefix has ended
        (an NSIS uninstaller re-launches itself from a temporary copy)."""
        done = subprocess.run(["wine", str(program), *args], env=self.env, timeout=timeout,
                              capture_output=True)
        subprocess.run(["wineserver", "-w"], env=self.env, timeout=timeout, check=True)
        return done.returncode

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
