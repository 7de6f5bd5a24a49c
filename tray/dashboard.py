"""Opening the dashboard with its buttons working, without the one-time code ever being
on a command line.

A browser is started with what it should open as an argument, and every process's
command line can be read by other users of the computer (``/proc/<pid>/cmdline``): a
program watching it once redeemed the code before the browser could. So the code goes
into a private page (0600, in the private instance folder) that sends the browser on to
``/ui#code=…``, and the browser is given that file. The dashboard redeems the code
at once, same-origin, as before. The page is deleted after ``KEEP_S``, and any left
behind (the second launch exits before then) the next time one is written.

What is opened is always built here: the server's own address (``http://127.0.0.1:<port>/ui``,
or ``[::1]`` for a server on IPv6) and
a code of the expected shape; never a URL or path from a server's answer (on Windows,
``webbrowser.open`` is ``os.startfile``, which runs programs).
"""

from __future__ import annotations

import contextlib
import html
import json
import secrets
import threading
import time
import webbrowser
from pathlib import Path

from app.host.user_files import create_private, private_folder, reason
from tray.client import ApiClient

KEEP_S = 60.0
PAGE_GLOB = "dashboard-*.html"


def launch_page(url: str) -> str:
    """A page that sends the browser on to ``url`` (meta refresh, and script for browsers
    that ignore it), with a link for the rare one that does neither."""
    attribute = html.escape(url, quote=True)
    script = json.dumps(url).replace("<", "\\u003c")
    return ('<!doctype html>\n<html><head><meta charset="utf-8">\n'
            '<meta name="referrer" content="no-referrer">\n'
            f'<meta http-equiv="refresh" content="0;url={attribute}">\n'
            "<title>Opening the vramguard dashboard</title>\n"
            f"<script>location.replace({script})</script>\n"
            f'</head><body><p><a href="{attribute}">Open the vramguard dashboard</a></p>'
            "</body></html>\n")


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


class DashboardOpener:
    """Opens the dashboard of the server ``client`` talks to (and has verified)."""

    def __init__(self, client: ApiClient, folder: Path, keep_s: float = KEEP_S) -> None:
        self.client = client
        self.folder = folder
        self.keep_s = keep_s

    def open(self) -> None:
        """Get a code, write the page, hand the page to the browser. Raises what the client
        raises (ServerDown, NotVramguard, RuntimeError); nothing is opened then."""
        code = self.client.dashboard_code()
        page = self._write(f"{self.client.base_url}/ui#code={code}")
        webbrowser.open(page.as_uri())
        timer = threading.Timer(self.keep_s, _remove, (page,))
        timer.daemon = True
        timer.start()

    def _write(self, url: str) -> Path:
        try:
            private_folder(self.folder)
            self._remove_old()
            page = self.folder / f"dashboard-{secrets.token_hex(8)}.html"
            create_private(page, launch_page(url).encode())
        except OSError as exc:
            raise RuntimeError(f"cannot write in {self.folder}: {reason(exc)}") from None
        return page

    def _remove_old(self) -> None:
        """Pages older than ``keep_s``: their codes were used or have expired."""
        cutoff = time.time() - self.keep_s
        for page in self.folder.glob(PAGE_GLOB):
            with contextlib.suppress(OSError):
                if page.lstat().st_mtime < cutoff:
                    page.unlink()
