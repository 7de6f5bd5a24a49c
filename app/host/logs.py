"""Logging to a rotating file in the per-user log folder (a windowed app has no
console) and to stderr: one line per event, with time, level and component. A message
repeated in a flood is kept a few times, then counted (`RepeatThrottle`)."""

from __future__ import annotations

import logging
import logging.handlers
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_BYTES = 5 * 1024**2
BACKUPS = 3
REPEATS_KEPT = 5  # of one message, per period
REPEAT_PERIOD_S = 60.0
MAX_MESSAGES = 100  # different messages counted per period; more share one count
_VERDICT = "vramguard_throttle_verdict"  # on a record: the throttle's verdict, once per record
_SUMMARY = "vramguard_throttle_summary"  # on a record: a summary, never throttled
_OTHERS = "<other messages>"


@dataclass
class _Count:
    first: str  # the first line of the first one, as logged
    kept: int = 0
    dropped: int = 0


def _first_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # a malformed call elsewhere must not break logging here
        text = str(record.msg)
    return (text.splitlines() or [""])[0][:200]


class RepeatThrottle(logging.Filter):
    """Keep the first `kept` records of each warning or error per period, drop the rest
    and log one line saying how many were dropped, so that a flood (46,889 accept()
    tracebacks in 4 s, once) cannot rotate the log's history away.

    Records are the same message when logger, level and message template match, so a
    flood whose numbers or addresses vary is still one message. Put one instance on every
    handler: it judges each record once. Summaries appear with the first record logged
    after the period, and at `flush`."""

    def __init__(self, kept: int = REPEATS_KEPT, period_s: float = REPEAT_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.kept = kept
        self.period_s = period_s
        self.clock = clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int, str], _Count] = {}
        self._period_end = clock() + period_s

    def filter(self, record: logging.LogRecord) -> bool:
        verdict = getattr(record, _VERDICT, None)
        if verdict is None:
            verdict = self._judge(record)
            setattr(record, _VERDICT, verdict)
        return bool(verdict)

    def flush(self) -> None:
        """Log the counts of the period so far (at exit: a flood that just ended)."""
        with self._lock:
            ended = self._end_period()
        self._summarise(ended)

    def _judge(self, record: logging.LogRecord) -> bool:
        if getattr(record, _SUMMARY, False):
            return True
        with self._lock:
            ended = self._end_period() if self.clock() >= self._period_end else {}
            keep = record.levelno < logging.WARNING or self._count(record)
        self._summarise(ended)
        return keep

    def _count(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        if key not in self._counts and len(self._counts) >= MAX_MESSAGES:
            key = (record.name, record.levelno, _OTHERS)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = _Count(_first_line(record))
        if count.kept < self.kept:
            count.kept += 1
            return True
        count.dropped += 1
        return False

    def _end_period(self) -> dict[tuple[str, int, str], _Count]:
        ended, self._counts = self._counts, {}
        self._period_end = self.clock() + self.period_s
        return ended

    def _summarise(self, ended: dict[tuple[str, int, str], _Count]) -> None:
        for (name, level, message), count in ended.items():
            if not count.dropped:
                continue
            what = "other messages" if message == _OTHERS else f'"{count.first}"'
            logging.getLogger(name).log(
                level, "%s repeated %d more times, left out of the log (only the first %d "
                "of a message are kept every %.0f s)", what, count.dropped, self.kept,
                self.period_s,
                extra={_SUMMARY: True})


def flush_repeats() -> None:
    """Log what the throttles on the root logger's handlers have left out so far."""
    throttles = {id(f): f for handler in logging.getLogger().handlers
                 for f in handler.filters if isinstance(f, RepeatThrottle)}
    for throttle in throttles.values():
        throttle.flush()


DEFAULT_PORT = 8765


def log_file_name(port: int = DEFAULT_PORT, part: str = "") -> str:
    """One file per port: two servers rotating one file would each rename it while the
    other has it open, which Windows refuses (and the two logs would interleave). The
    tray launcher (``part`` "tray") keeps its own beside the server's, for the same
    reason: ``vramguard-tray.log``."""
    stem = f"vramguard-{part}" if part else "vramguard"
    return f"{stem}.log" if port == DEFAULT_PORT else f"{stem}-{port}.log"


def setup_logging(level: str, log_dir: Path | None, port: int = DEFAULT_PORT,
                  part: str = "") -> Path | None:
    """Send every logger (uvicorn's included) to the file (none when ``log_dir`` is None:
    the folder cannot be written) and to stderr where there is one (a windowed program
    has none: then the file is all there is); return the file."""
    handlers: list[logging.Handler] = [logging.StreamHandler()] if sys.stderr else []
    path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / log_file_name(port, part)
        handlers.append(logging.handlers.RotatingFileHandler(
            path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8"))
    formatter = logging.Formatter(FORMAT)
    throttle = RepeatThrottle()
    root = logging.getLogger()
    root.handlers.clear()
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(throttle)
        root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    return path
