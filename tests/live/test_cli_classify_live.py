"""`vramguard classify` with no server running: it starts a real one for the run and stops
it (against the app in a thread: inprocess/test_cli_classify.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from photo_tree import photo_tree

from bench.process import ROOT, free_port, server_env


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    return photo_tree(tmp_path)


def test_starts_a_server_for_the_run_when_none_answers(
        tmp_path: Path, tree: dict[str, Path]) -> None:
    port = free_port()  # where discovery looks: nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "app", "classify", str(tree["a"]), "--json"], cwd=ROOT,
        env={**server_env(VRAMGUARD_PORT=str(port)),
             "PYTHONPATH": str(ROOT / "clients" / "python"),
             **{k: v for k, v in os.environ.items() if k.startswith(("HOME", "XDG_"))}},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "no vramguard is running; starting one for this run" in done.stderr
    started = re.search(r"started at (http://127\.0\.0\.1:(\d+))", done.stderr)
    assert started is not None
    assert json.loads(done.stdout)["predictions"]
    with pytest.raises(httpx.ConnectError):  # stopped at the end
        httpx.get(f"{started.group(1)}/healthz", timeout=2)
