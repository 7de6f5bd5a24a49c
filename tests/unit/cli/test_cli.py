"""The `vramguard` command as a person runs it: messages, not tracebacks."""

from __future__ import annotations

import socket

import pytest
from cli_process import run_cli

from app.cli.main import main


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


def test_listening_beyond_this_computer_needs_allow_remote(capsys):
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 1
    assert "--allow-remote" in capsys.readouterr().err


def test_a_broken_config_file_is_one_message_naming_it(tmp_path, capsys):
    broken = tmp_path / "config.toml"
    broken.write_text("port = \n")
    assert main(["serve", "--config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "move the file away" in err and "Traceback" not in err
    typo = tmp_path / "typo.toml"
    typo.write_text("prot = 8780\n")
    assert main(["serve", "--config", str(typo)]) == 2
    assert f"unknown setting 'prot' in {typo}" in capsys.readouterr().err
