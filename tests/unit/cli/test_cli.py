"""The `vramguard` command as a person runs it: messages, not tracebacks."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import ROOT, live_server

from app.cli.main import main


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow  # loads the model and times every batch size up to 32
def test_doctor_checks_torch_device_and_model():
    result = run_cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    for expected in ("torch", "NVIDIA GPU", "device", "cpu", "efficientnet_lite0 loaded",
                     "per image", "= budget", "x fraction", "all checks passed"):
        assert expected in result.stdout


def test_doctor_fails_clearly_for_a_missing_gpu_or_model(capsys):
    assert main(["doctor", "--model", "resnet50"]) == 1
    assert "No weights for 'resnet50'" in capsys.readouterr().out
    if not __import__("torch").cuda.is_available():
        assert main(["doctor", "--device", "cuda"]) == 1
        assert "no NVIDIA GPU" in capsys.readouterr().out


def test_serve_refuses_a_taken_port_with_advice(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"Port {port} is used by another program" in err and "--port" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "resnet50"], "No weights for 'resnet50'"),
    (["--model", "nonsense"], "Unknown model 'nonsense'"),
])
def test_serve_refuses_a_model_it_cannot_load(capsys, args, message):
    assert main(["serve", "--port", "1", *args]) == 1
    assert message in capsys.readouterr().err


def test_version_and_help():
    assert "vramguard 0.1.0" in run_cli("--version").stdout
    assert "--no-cache" in run_cli("serve", "--help").stdout


@pytest.mark.slow
def test_sigterm_stops_the_server_cleanly(tmp_path):
    with live_server(tmp_path, "--no-cache") as server:
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
    log = server.log_text()
    assert "Traceback" not in log and "Shutting down" in log


@pytest.mark.slow
def test_server_logs_to_a_rotating_file_in_the_user_log_folder(tmp_path):
    with live_server(tmp_path, "--no-cache") as server:
        port = server.url.rsplit(":", 1)[1]
        log_file = (Path(server.home) / "xdg_state_home" / "vramguard" / "log" /
                    f"vramguard-{port}.log")  # not the default port: a file of its own
        text = log_file.read_text()
    assert "INFO vramguard.engine: ready:" in text and "INFO uvicorn" in text
    assert "doctor" not in text
    doctor = run_cli("doctor")
    assert "log folder" in doctor.stdout
