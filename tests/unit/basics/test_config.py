"""Settings precedence (CLI > env > TOML > default) and errors that name the setting."""

from __future__ import annotations

import pytest

from app.cli.main import main
from app.config import ConfigError, default_config_file, load_settings


def test_defaults():
    settings = load_settings()
    assert (settings.host, settings.port, settings.model) == ("127.0.0.1", 8765,
                                                              "efficientnet_lite0")
    assert settings.cache and int(settings.cache_size) == 256 * 1024**2


def test_precedence_cli_over_env_over_toml_over_default(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text('port = 7001\nqueue_size = 11\nmax_body_bytes = "2MiB"\n')
    settings = load_settings(config)
    assert (settings.port, settings.queue_size, int(settings.max_body_bytes)) == (
        7001, 11, 2 * 1024**2)
    monkeypatch.setenv("VRAMGUARD_PORT", "7002")
    assert load_settings(config).port == 7002
    assert load_settings(config, port=7003).port == 7003
    assert load_settings(config, port=None).port == 7002  # an option not given is no override
    assert load_settings(config).queue_size == 11


def test_per_user_config_file_is_read():
    path = default_config_file()
    path.parent.mkdir(parents=True)
    path.write_text("cache = false\n")
    assert load_settings().cache is False


def test_config_file_from_the_environment(tmp_path, monkeypatch):
    config = tmp_path / "other.toml"
    config.write_text("port = 7100\n")
    monkeypatch.setenv("VRAMGUARD_CONFIG", str(config))
    assert load_settings().port == 7100


def test_cache_off_from_the_environment(monkeypatch):
    monkeypatch.setenv("VRAMGUARD_CACHE", "0")
    assert load_settings().cache is False


@pytest.mark.parametrize(("env", "value", "named"), [
    ("VRAMGUARD_PORT", "99999", "port"),
    ("VRAMGUARD_DEVICE", "gpu", "device"),
    ("VRAMGUARD_MAX_BODY_BYTES", "lots", "max_body_bytes"),
    ("VRAMGUARD_QUEUE_SIZE", "0", "queue_size"),
])
def test_invalid_values_name_the_setting(monkeypatch, env, value, named):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=f"'{named}'"):
        load_settings()


def test_unknown_and_malformed_toml(tmp_path):
    typo = tmp_path / "typo.toml"
    typo.write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'prot'"):
        load_settings(typo)
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml")


def test_cli_reports_config_errors_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("VRAMGUARD_PORT", "nope")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "setting 'port'" in err and "Traceback" not in err


def test_readme_documents_every_setting():
    from pathlib import Path

    from app.config import Settings

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    missing = [name for name in Settings.model_fields if f"| `{name}` |" not in readme]
    assert not missing, f"settings missing from the README's table: {missing}"


def test_a_misspelt_variable_is_warned_about_with_the_closest_name():
    from app.config import unknown_variables

    warnings = unknown_variables({
        "VRAMGUARD_CLASIFY_BURST": "2", "vramguard_prot": "8780", "VRAMGUARD_XYZZY": "1",
        "VRAMGUARD_PORT": "8780", "vramguard_queue_size": "3", "VRAMGUARD_CONFIG": "c.toml",
        "HOME": "/home/me", "MY_VRAMGUARD_PORT": "1"})
    assert warnings == [
        "The environment variable VRAMGUARD_CLASIFY_BURST is not a vramguard setting, so it "
        "changes nothing. Did you mean VRAMGUARD_CLASSIFY_BURST?",
        "The environment variable VRAMGUARD_XYZZY is not a vramguard setting, so it changes "
        "nothing.",
        "The environment variable vramguard_prot is not a vramguard setting, so it changes "
        "nothing. Did you mean VRAMGUARD_PORT?",
    ]


def test_every_variable_the_settings_read_is_known(monkeypatch):
    """What the warning calls unknown is what the settings ignore, and the reverse."""
    from app.config import Settings, unknown_variables

    for name in Settings.model_fields:
        assert unknown_variables({f"VRAMGUARD_{name.upper()}": "x"}) == []
    monkeypatch.setenv("VRAMGUARD_CLASIFY_BURST", "2")
    assert load_settings().classify_burst == 100  # ignored, hence the warning
