"""Fixtures of the desktop tier's page tests: headless Chromium and another site."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import another_site, browser_session


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium, 1280 x 800 (the screenshots' size)."""
    with browser_session() as driver:
        yield driver


@pytest.fixture
def other_site(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """Another site than vramguard's: a served folder and its URL."""
    with another_site(tmp_path) as site:
        yield site
