"""The `vramguard` command as a person runs it: messages, not tracebacks."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest
from cli_process import run_cli

from app.cli.main import build_parser, main
from app.config import Settings, load_settings


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


# Every option `vramguard serve` had before its options were made from the settings: none
# may change (tests, scripts and the docs use them).
EARLIER_OPTIONS = (
    "--config", "--model", "--weights", "--device", "--host", "--port", "--max-batch-size",
    "--max-wait-ms", "--target-latency-ms", "--queue-size", "--request-timeout-s",
    "--cache-dir", "--no-cache", "--log-level", "--allow-remote", "--batch-size",
    "--cpu-memory-cap", "--memory-fraction", "--memory-budget", "--models", "--keep-alive-s",
    "--idle-release-s", "--launched-by")


def _serve_options() -> dict[str, argparse.Action]:
    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return {flag: action for action in serve._actions for flag in action.option_strings}


def test_every_setting_is_an_option_of_serve_and_in_its_help():
    options = _serve_options()
    assert set(EARLIER_OPTIONS) <= set(options)
    text = run_cli("serve", "--help").stdout
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert flag in options and options[flag].dest == name, flag
        assert flag in text, f"{flag} is not in `vramguard serve --help`"
    assert "--no-rate-limit" in text and "VRAMGUARD_<NAME>" in text


def _settings_from(*argv: str) -> Settings:
    args = build_parser().parse_args(["serve", *argv])
    return load_settings(**{key: value for key, value in vars(args).items()
                            if key in Settings.model_fields})


def test_options_reach_the_settings_in_each_kind():
    settings = _settings_from(
        "--classify-burst", "2", "--classify-per-s", "0.5", "--no-rate-limit",
        "--allow-remote", "--no-cache", "--memory-budget", "2GiB", "--max-wait-ms", "1.5",
        "--decode-workers", "3", "--models", "efficientnet_lite1, efficientnet_lite2",
        "--cors-origins", "http://localhost:3000,http://localhost:5173",
        "--api-key-file", "/keys/vramguard", "--redis-url", "redis://127.0.0.1:6379/0")
    assert (settings.classify_burst, settings.classify_per_s) == (2, 0.5)
    assert (settings.rate_limit, settings.allow_remote, settings.cache) == (False, True, False)
    assert int(settings.memory_budget or 0) == 2 * 1024**3
    assert (settings.max_wait_ms, settings.decode_workers) == (1.5, 3)
    assert settings.models == ["efficientnet_lite1", "efficientnet_lite2"]
    assert settings.cors_origins == ["http://localhost:3000", "http://localhost:5173"]
    assert settings.api_key_file == Path("/keys/vramguard")
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert _settings_from("--rate-limit").rate_limit is True
    defaults = _settings_from()  # an option not given changes nothing
    assert (defaults.classify_burst, defaults.rate_limit, defaults.max_wait_ms) == (100, True,
                                                                                   None)


def test_an_option_over_the_environment_and_the_config_file(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text("classify_burst = 7\nqueue_size = 9\n")
    monkeypatch.setenv("VRAMGUARD_QUEUE_SIZE", "8")
    settings = _settings_from("--config", str(config), "--classify-burst", "2")
    assert (settings.classify_burst, settings.queue_size) == (2, 8)


@pytest.mark.parametrize(("argv", "named"), [
    (["--classify-burst", "lots"], "'classify_burst'"),
    (["--classify-burst", "0"], "'classify_burst'"),
    (["--cors-origins", "*"], "'cors_origins'"),
    (["--max-body-bytes", "big"], "'max_body_bytes'"),
])
def test_a_bad_option_value_names_the_setting(capsys, argv, named):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def _readme_section(title: str) -> str:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    start = readme.index(f"\n## {title}\n")
    return readme[start:readme.index("\n## ", start + 1)]


@pytest.mark.parametrize("title", ["Configuration", "Troubleshooting"])
def test_the_options_the_readme_shows_are_options_and_their_values_valid(title):
    """`--classify-burst 2` was "unrecognized arguments" while Troubleshooting said to
    raise classify_burst: every option these sections show must parse and be accepted."""
    options = _serve_options()
    spans = re.findall(r"`(?:vramguard serve )?(--[a-z][^`]*)`", _readme_section(title))
    assert spans
    for span in spans:
        words = span.split()
        assert words[0] in options or words == ["--help"], f"README shows {span!r}"
        if len(words) > 1:
            _settings_from(*words)
