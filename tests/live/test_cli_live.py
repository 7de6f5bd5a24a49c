"""The `vramguard` command against the real model and a real server: `doctor`'s whole
check, a clean stop on SIGTERM, the rotating log file and the warnings in it (the rest:
unit/cli/test_cli.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from cli_process import run_cli
from live_server import ROOT, live_server


# loads the model and times every batch size up to 32
def test_doctor_checks_torch_device_and_model():
    result = run_cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    for expected in ("torch", "NVIDIA GPU", "device", "cpu", "efficientnet_lite0 loaded",
                     "memory per image", "= room for images", "x fraction", "all checks passed"):
        assert expected in result.stdout


def test_sigterm_stops_the_server_cleanly(tmp_path):
    with live_server(tmp_path, "--no-cache") as server:
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
    log = server.log_text()
    assert "Traceback" not in log and "Shutting down" in log


def test_server_logs_to_a_rotating_file_in_the_user_log_folder(tmp_path):
    """The log file; in it and on stderr, once, the warning about a misspelt variable."""
    with live_server(tmp_path, "--no-cache",
                     env={"VRAMGUARD_CLASIFY_BURST": "2"}) as server:
        port = server.url.rsplit(":", 1)[1]
        log_file = (Path(server.home) / "xdg_state_home" / "vramguard" / "log" /
                    f"vramguard-{port}.log")  # not the default port: a file of its own
        text = log_file.read_text()
    assert "INFO vramguard.engine: ready:" in text and "INFO uvicorn" in text
    assert "doctor" not in text
    warning = ("WARNING vramguard: The environment variable VRAMGUARD_CLASIFY_BURST is not a "
               "vramguard setting, so it changes nothing. Did you mean "
               "VRAMGUARD_CLASSIFY_BURST?")
    assert text.count(warning) == 1
    assert server.log_text().count(warning) == 1  # stderr
    doctor = run_cli("doctor")
    assert "log folder" in doctor.stdout


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    """`vramguard models list | grep -q NAME` under `set -o pipefail` (how .ci/first_use.sh
    first met it): the reader is gone before the listing is written."""
    env = {**os.environ, "VRAMGUARD_MODELS_DIR": str(tmp_path / "models")}
    listing = subprocess.Popen([sys.executable, "-m", "app", "models", "list"], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert listing.stdout is not None and listing.stderr is not None
    listing.stdout.close()  # before the program has written anything
    errors = listing.stderr.read().decode()
    assert listing.wait(60) == 1
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors
