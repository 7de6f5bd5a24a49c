"""Headless Chromium for the page tests, and a second site for the attacks on them."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from live_server import free_port


def require_chromium() -> None:
    """Skip the calling test module where selenium, Chromium or its driver is missing."""
    pytest.importorskip("selenium.webdriver")
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("chromium and chromedriver are not installed", allow_module_level=True)


def open_browser(width: int = 1280, height: int = 800) -> Any:
    """Headless Chromium with a window of this size (the screenshots' size)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


@contextmanager
def browser_session(width: int = 1280, height: int = 800) -> Iterator[Any]:
    driver = open_browser(width, height)
    try:
        yield driver
    finally:
        driver.quit()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        """No line per request on the test's output."""


@contextmanager
def another_site(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder served on another port, reached as http://localhost:<port>: another site
    than http://127.0.0.1:<vramguard's port>. Yields the folder and the site's URL."""
    folder = tmp_path / "site"
    folder.mkdir()
    port = free_port()
    site = ThreadingHTTPServer(("127.0.0.1", port), partial(_Quiet, directory=str(folder)))
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield folder, f"http://localhost:{port}"
    finally:
        site.shutdown()
        site.server_close()


def wait_until(predicate: Any, timeout: float = 30.0) -> None:
    """Poll ``predicate`` (a page's state) every 0.2 s until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
