"""The support report of a real server: what a person attaches to a bug report, with the
admin token left out even where a log holds it."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import httpx
from live_server import live_server


def _report(url: str, headers: dict[str, str]) -> zipfile.ZipFile:
    answer = httpx.get(f"{url}/v1/support-report", headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/zip"
    assert "vramguard-support-" in answer.headers["content-disposition"]
    return zipfile.ZipFile(io.BytesIO(answer.content))


def test_the_support_report_carries_the_checks_memory_and_logs_but_not_the_token(tmp_path):
    with live_server(tmp_path) as running:
        assert httpx.get(f"{running.url}/v1/support-report", timeout=30).status_code == 401
        with _report(running.url, running.admin()) as first:
            settings = json.loads(first.read("settings.json"))
            log_dir = Path(settings["log_dir"])
        (log_dir / "vramguard-planted.log").write_text(f"a line with {running.token()}\n")
        with _report(running.url, running.admin()) as report:
            names = set(report.namelist())
            assert {"doctor.txt", "memory.json", "stats.json", "models.json",
                    "settings.json", "logs/vramguard-planted.log"} <= names
            assert any(name.startswith("logs/vramguard-") and "planted" not in name
                       for name in names)  # the server's own log
            doctor = report.read("doctor.txt").decode()
            assert "ok vramguard" in doctor and "device" in doctor
            memory = json.loads(report.read("memory.json"))
            assert memory["budget_bytes"] > 0
            models = json.loads(report.read("models.json"))
            assert any(model["name"] == settings["model"] for model in models["models"])
            for name in names:
                assert running.token().encode() not in report.read(name), name
            assert b"[left out]" in report.read("logs/vramguard-planted.log")
