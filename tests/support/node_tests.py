"""The JavaScript client's (clients/js) tests under Node's own test runner, and the mark
that skips them where Node 18 or later is missing (.ci/run installs the Debian package
nodejs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from live_server import ROOT

__all__ = ["CLIENT", "NODE", "needs_node", "run_node_tests"]

CLIENT = ROOT / "clients" / "js"
NODE = shutil.which("node")


def _node_major() -> int:
    if NODE is None:
        return 0
    version = subprocess.run([NODE, "--version"], capture_output=True, text=True, timeout=30)
    found = re.match(r"v(\d+)\.", version.stdout.strip())
    return int(found.group(1)) if found else 0


needs_node = pytest.mark.skipif(
    _node_major() < 18, reason="the JavaScript client's tests need Node 18 or later "
    "(`node` on PATH; Debian: apt-get install nodejs)")


def run_node_tests(*files: str, env: dict[str, str] | None = None) -> str:
    """``node --test`` over ``files`` (in clients/js/test); fail with its report unless
    every test passed and none was skipped."""
    assert NODE is not None
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    result = subprocess.run([NODE, "--test", *(f"test/{name}" for name in files)],
                            cwd=CLIENT, env={**inherited, **(env or {})},
                            capture_output=True, text=True, timeout=600)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "# SKIP" not in report, report
    passed = re.search(r"^# pass (\d+)$", report, re.MULTILINE)
    assert passed and int(passed.group(1)) > 0, report
    return report
