"""The log throttle: a flood of one message keeps a few lines and a count, never the
whole rotation (which once lost every earlier log to 46,889 accept() tracebacks)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from app.host import logs
from app.host.logs import RepeatThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def throttled(clock: Clock) -> Iterator[tuple[logging.Logger, list[Collect]]]:
    """A logger with two handlers sharing one throttle (the file and stderr, in the app)."""
    throttle = RepeatThrottle(kept=3, period_s=60, clock=clock)
    handlers = [Collect(), Collect()]
    logger = logging.getLogger("test.throttle")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    for handler in handlers:
        handler.addFilter(throttle)
        logger.addHandler(handler)
    yield logger, handlers
    for handler in handlers:
        logger.removeHandler(handler)
    logger.propagate = True


def test_a_flood_keeps_the_first_few_and_then_one_count(throttled, clock):
    logger, (first, second) = throttled
    for port in range(1000):
        logger.error("accept failed for port %d", port)
    assert first.lines == [f"ERROR accept failed for port {port}" for port in range(3)]
    assert second.lines == first.lines  # judged once per record, not once per handler
    clock.now += 61
    logger.error("accept failed for port %d", 1000)
    assert first.lines[3:] == [
        'ERROR "accept failed for port 0" repeated 997 more times, left out of the log '
        "(only the first 3 of a message are kept every 60 s)",
        "ERROR accept failed for port 1000"]  # a new period keeps it again
    assert second.lines == first.lines


def test_info_lines_and_different_messages_are_not_held_back(throttled):
    logger, (collected, _) = throttled
    for _ in range(5):
        logger.info("request answered")
        logger.warning("cache full")
        logger.error("cache full")  # another level: another message
    assert collected.lines.count("INFO request answered") == 5
    assert collected.lines.count("WARNING cache full") == 3
    assert collected.lines.count("ERROR cache full") == 3


def test_flush_logs_the_count_of_a_flood_that_just_ended(throttled):
    logger, (collected, _) = throttled
    for _ in range(10):
        logger.warning("slow disk")
    logs.flush_repeats()  # the root logger's throttles: none of these
    assert len(collected.lines) == 3
    throttle = collected.filters[0]
    assert isinstance(throttle, RepeatThrottle)
    throttle.flush()
    assert collected.lines[-1].startswith('WARNING "slow disk" repeated 7 more times')
    throttle.flush()
    assert len(collected.lines) == 4  # nothing left to say


def test_too_many_different_messages_share_one_count(throttled, clock):
    logger, (collected, _) = throttled
    for number in range(logs.MAX_MESSAGES + 50):
        logger.error(f"unique {number}")  # preformatted: each text is its own message
    assert len(collected.lines) == logs.MAX_MESSAGES + 3
    clock.now += 61
    logger.info("later")
    assert collected.lines[-2].startswith("ERROR other messages repeated 47 more times")


def test_setup_logging_throttles_the_file_and_stderr(tmp_path, capsys):
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        log_file = logs.setup_logging("info", tmp_path)
        assert log_file is not None
        asyncio_log = logging.getLogger("asyncio")
        for _ in range(10_000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                asyncio_log.exception("socket.accept() out of system resource")
        logs.flush_repeats()
        for handler in root.handlers:
            handler.close()
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    text = log_file.read_text()
    assert text.count("Traceback") == logs.REPEATS_KEPT
    assert "repeated 9995 more times" in text
    assert capsys.readouterr().err.count("Traceback") == logs.REPEATS_KEPT


def test_servers_on_different_ports_log_to_different_files(tmp_path):
    """Rotation renames the file: on Windows that fails while another server has it open."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        default = logs.setup_logging("info", tmp_path)
        for handler in root.handlers:
            handler.close()
        other = logs.setup_logging("info", tmp_path, 8766)
        for handler in root.handlers:
            handler.close()
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert default is not None and default.name == "vramguard.log"
    assert other is not None and other.name == "vramguard-8766.log"


def test_a_windowed_launcher_logs_to_its_own_file_only(tmp_path, monkeypatch):
    """No stderr (a windowed program): no stream handler to fail on every line, the file
    ``vramguard-tray.log`` (with the port when it is not the default) has it all."""
    monkeypatch.setattr("sys.stderr", None)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        path = logs.setup_logging("info", tmp_path, part="tray")
        assert path == tmp_path / "vramguard-tray.log"
        assert all(isinstance(h, logging.FileHandler) for h in root.handlers)
        logging.getLogger("vramguard.tray").info("a line of the launcher")
        for handler in root.handlers:
            handler.flush()
        assert "a line of the launcher" in path.read_text()
        assert logs.log_file_name(8780, "tray") == "vramguard-tray-8780.log"
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
