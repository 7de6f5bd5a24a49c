"""Run the `vramguard` command (``python -m app``) in a process of its own, as a person
would, and wait for it."""

from __future__ import annotations

import subprocess
import sys

from live_server import ROOT

__all__ = ["run_cli"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
