"""The support report's file: bounded logs, no secrets, every part readable."""

from __future__ import annotations

import io
import json
import os
import zipfile

from app.host.support_bundle import (
    HIDDEN,
    LOG_TAIL_BYTES,
    MAX_LOG_FILES,
    build_report,
    log_tails,
    mask_url_passwords,
    scrub,
)


def test_only_the_newest_logs_go_in_and_only_their_ends(tmp_path):
    for index in range(MAX_LOG_FILES + 3):
        path = tmp_path / f"vramguard-{index}.log"
        path.write_bytes(b"x")
        os.utime(path, (index, index))
    big = tmp_path / "vramguard-big.log"
    big.write_bytes(b"a" * LOG_TAIL_BYTES + b"THE END")
    tails = log_tails(tmp_path)
    assert len(tails) == MAX_LOG_FILES
    assert "vramguard-big.log" in tails and "vramguard-0.log" not in tails
    assert len(tails["vramguard-big.log"]) == LOG_TAIL_BYTES
    assert tails["vramguard-big.log"].endswith(b"THE END")


def test_a_link_out_of_the_log_folder_is_not_followed(tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("private")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "vramguard.log").symlink_to(outside)
    (logs / "real.log").write_text("line")
    assert set(log_tails(logs)) == {"real.log"}


def test_a_missing_log_folder_gives_no_logs(tmp_path):
    assert log_tails(tmp_path / "none") == {}


def test_secrets_and_url_passwords_are_left_out():
    data = b"token abcdef123 in a line; redis://:hunter22@host:6379/0 and redis://u:pw@h"
    out = scrub(data, ["abcdef123", "", "ab"])
    assert b"abcdef123" not in out and b"hunter22" not in out and b":pw@" not in out
    assert out.count(HIDDEN.encode()) == 3
    assert mask_url_passwords("http://host:8765/v1") == "http://host:8765/v1"


def test_the_report_holds_each_part_scrubbed(tmp_path):
    report = build_report({"notes.txt": "key KEY-0123456789", "settings.json": {"port": 1},
                           "raw.bin": b"KEY-0123456789"},
                          {"vramguard.log": b"started with KEY-0123456789"},
                          ["KEY-0123456789"])
    with zipfile.ZipFile(io.BytesIO(report)) as opened:
        names = set(opened.namelist())
        assert names == {"notes.txt", "settings.json", "raw.bin", "logs/vramguard.log"}
        assert json.loads(opened.read("settings.json")) == {"port": 1}
        for name in names:
            assert b"KEY-0123456789" not in opened.read(name)
