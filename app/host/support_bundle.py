"""A support report: one zip file a person attaches to a bug report, so that whoever
reads it sees what their computer and their vramguard did.

It holds the ends of the newest log files, `vramguard doctor`'s lines, the memory report,
the counters, the models and the settings in force. Secrets never go in: the admin token
and the API key are cut out of every file in it wherever they appear, and a password in a
setting's URL (``redis://:secret@host``) is masked. Its size is bounded: at most
``MAX_LOG_FILES`` logs, the last ``LOG_TAIL_BYTES`` of each, whatever the log folder holds.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

LOG_TAIL_BYTES = 2 * 1024 * 1024
MAX_LOG_FILES = 6
HIDDEN = "[left out]"
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@/\s]+@",
                           re.IGNORECASE)


def log_tails(log_dir: Path) -> dict[str, bytes]:
    """The newest log files of ``log_dir`` (regular files only: a link could point out of
    the folder), each cut to its last ``LOG_TAIL_BYTES``, by file name."""
    try:
        files = [path for path in log_dir.iterdir()
                 if ".log" in path.name and path.is_file() and not path.is_symlink()]
    except OSError:
        return {}
    files.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    tails: dict[str, bytes] = {}
    for path in files[:MAX_LOG_FILES]:
        try:
            with path.open("rb") as log:
                size = log.seek(0, io.SEEK_END)
                log.seek(max(0, size - LOG_TAIL_BYTES))
                tails[path.name] = log.read(LOG_TAIL_BYTES)
        except OSError:
            continue
    return tails


def mask_url_passwords(text: str) -> str:
    return _URL_PASSWORD.sub(rf"\g<scheme>\g<user>:{HIDDEN}@", text)


def scrub(data: bytes, secrets: Iterable[str]) -> bytes:
    """``data`` with every secret (longer than 3 characters) and URL password replaced."""
    for secret in secrets:
        if len(secret) > 3:
            data = data.replace(secret.encode(), HIDDEN.encode())
    return mask_url_passwords(data.decode("utf-8", errors="replace")).encode()


def build_report(parts: Mapping[str, str | bytes | object], logs: Mapping[str, bytes],
                 secrets: Iterable[str]) -> bytes:
    """The zip: ``parts`` by file name (text as it is, anything else as JSON), the logs
    under ``logs/``; every file scrubbed of ``secrets``."""
    hidden = [secret for secret in secrets if secret]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as report:
        for name, value in parts.items():
            if isinstance(value, bytes):
                data = value
            elif isinstance(value, str):
                data = value.encode()
            else:
                data = json.dumps(value, indent=2, default=str).encode()
            report.writestr(name, scrub(data, hidden))
        for name, data in logs.items():
            report.writestr(f"logs/{name}", scrub(data, hidden))
    return out.getvalue()
