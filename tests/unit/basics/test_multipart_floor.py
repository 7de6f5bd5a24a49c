"""The image stream's parser, python-multipart, refuses a part header over its limit: the
floor in pyproject.toml is the first release that does (0.0.27; 0.0.26 kept an endless
header in memory and parsed it byte by byte in the event loop: 4 MiB of one accepted),
and the installed one refuses a header past 4 KiB in the chunk that crosses it. The
attack on a real server: ``tests/live/test_stream_parser_live.py``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser

ROOT = Path(__file__).resolve().parents[3]
FIRST_WITH_A_HEADER_LIMIT = (0, 0, 27)


def floor() -> tuple[int, ...]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"]
    found = [d for d in dependencies if d.startswith("python-multipart")]
    assert len(found) == 1, dependencies
    match = re.fullmatch(r"python-multipart>=([0-9.]+)(,.*)?", found[0])
    assert match, found[0]
    return tuple(int(n) for n in match[1].split("."))


def test_the_floor_is_a_release_with_the_part_header_limit() -> None:
    assert floor() >= FIRST_WITH_A_HEADER_LIMIT


@pytest.mark.parametrize("start", [b'Content-Disposition: form-data; name="file"; filename="',
                                   b"X-Endless-"], ids=["value", "name"])
def test_an_endless_part_header_is_refused_past_4_kib(start: bytes) -> None:
    parser = MultipartParser(b"B", {})
    parser.write(b"--B\r\n" + start + b"a" * 4000)  # a long header, within the limit
    with pytest.raises(MultipartParseError, match="header size"):
        parser.write(b"a" * 65536)
