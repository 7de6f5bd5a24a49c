"""Logging to a rotating file in the per-user log folder (a windowed app has no
console) and to stderr: one line per event, with time, level and component."""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_BYTES = 5 * 1024**2
BACKUPS = 3


def setup_logging(level: str, log_dir: Path) -> Path:
    """Send every logger (uvicorn's included) to the file and to stderr; return the file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "vramguard.log"
    formatter = logging.Formatter(FORMAT)
    to_file = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES,
                                                   backupCount=BACKUPS, encoding="utf-8")
    to_stderr = logging.StreamHandler()
    root = logging.getLogger()
    root.handlers.clear()
    for handler in (to_file, to_stderr):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    return path
