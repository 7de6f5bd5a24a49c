"""The attacks of a web page, run by a real browser (headless Chromium) against a real
server: a page on another site fires 110 Origin-less ``<img>`` GETs at /v1/classify,
opens /v1/events through a ``<script>`` tag and frames /ui. Skipped where Chromium is not
installed; the same requests are checked in process in ``tests/inprocess/test_browser_gates.py``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from browser import require_chromium
from images import photo
from live_server import live_server

require_chromium()

DRAIN = 110  # one more than the classify burst (100) and then some, as in the issue
PAGE = """<!doctype html><title>loading</title><body><script>
let settled = 0;
for (let i = 0; i < {drain}; i++) {{
  const img = new Image();
  img.onload = img.onerror = () => {{ if (++settled === {drain}) document.title = "done"; }};
  img.src = "{api}/v1/classify?i=" + i;
}}
const script = document.createElement("script");
script.src = "{api}/v1/events";
document.body.appendChild(script);
const frame = document.createElement("iframe");
frame.src = "{api}/ui";
document.body.appendChild(frame);
</script></body>"""


def test_a_page_on_another_site_drains_nothing_and_opens_nothing(
        tmp_path: Path, browser: Any, other_site: tuple[Path, str]) -> None:
    folder, site_url = other_site
    with live_server(tmp_path, "--no-cache") as running, running.client() as http:
        (folder / "attack.html").write_text(PAGE.format(drain=DRAIN, api=running.url))
        browser.get(f"{site_url}/attack.html")
        deadline = time.monotonic() + 60
        while browser.title != "done":
            assert time.monotonic() < deadline, "the page's requests did not all finish"
            time.sleep(0.2)
        while (stats := http.get("/v1/stats", headers={"X-Client-Id": "monitor"}).json()
               )["requests"].get("forbidden", 0) < DRAIN + 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # the script tag and the frame may come after the images
        local_app = http.post("/v1/classify", content=photo(),
                              headers={"Content-Type": "image/jpeg"})
    assert local_app.status_code == 200, local_app.text  # no X-Client-Id: the browser's bucket
    assert stats["rate_limited"] == 0
    assert stats["requests"] == {"forbidden": DRAIN + 2}  # the images, the script, the frame
