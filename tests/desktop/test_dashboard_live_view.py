"""The dashboard's live view while a program holds every open ``/v1/events`` slot (one
stream under each of ever new client ids), in headless Chromium against a real server.

The page opened from the tray's link sends its session with the stream and is given the
slot kept for it: its chart moves. A page without a session is refused as any program
would be, says so as it always did, and follows the stream again once a slot is free.
The rule on the server: ``tests/live/test_event_slots_live.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from browser import require_chromium, wait_until
from live_server import LiveServer, live_server
from live_views import open_slots_taken

from app.http.live_feed import MAX_SUBSCRIBERS

require_chromium()


def points(browser: Any) -> int:
    """The samples the page's chart holds: each came over its live view."""
    return int(browser.find_element("id", "chart").get_attribute("data-points"))


def test_the_signed_in_dashboard_keeps_its_live_view_with_every_open_slot_taken(
        tmp_path: Path, browser: Any) -> None:
    with live_server(tmp_path, "--no-cache") as server:
        with open_slots_taken(server.url) as held:
            assert held < MAX_SUBSCRIBERS  # the kept slots are all that is left
            link = httpx.post(f"{server.url}/v1/admin/ui-link",
                              headers=server.admin()).json()["url"]
            browser.get(link)
            wait_until(lambda: points(browser) >= 2)
            assert browser.find_element("id", "state").get_attribute("class") in {
                "ok", "high", "shedding"}

            browser.switch_to.new_window("tab")  # a tab of its own: no session
            browser.get(f"{server.url}/ui")
            wait_until(lambda: browser.find_element("id", "state").text == "not running")
            assert points(browser) == 0
        wait_until(lambda: points(browser) >= 1)  # a slot is free: it follows again
        assert browser.find_element("id", "state").get_attribute("class") in {
            "ok", "high", "shedding"}


STREAM = (  # as in tests/unit/tray/test_tray_events.py: what the tray's parser is held to
    "retry: 2000\n\n"
    ": a comment, as a keep-alive\n"
    'event: state\ndata: {"state":"high","t":1.5}\n\n'
    'event: sample\r\ndata:{"a":\r\ndata: 1}\r\n\r\n'  # CRLF, no space, two data lines
    "data: plain\rid: 7\r\r"  # CR alone; no event name; a field the page ignores
    "event: empty\n\n"  # no data: nothing to dispatch
    "retry: soon\n"  # not a number: ignored
    "data: not ended yet\n"
)
EXPECTED = [["state", '{"state":"high","t":1.5}'], ["sample", '{"a":\n1}'],
            ["message", "plain"]]


def test_the_pages_event_parser_is_indifferent_to_where_the_network_splits(
        server: LiveServer, browser: Any) -> None:
    browser.get(f"{server.url}/ui")
    outcomes = browser.execute_script("""
        const text = arguments[0], outcomes = [];
        for (let cut = 0; cut <= text.length; cut++) {
          const events = [], parser = eventParser((kind, data) => events.push([kind, data]));
          parser.feed(text.slice(0, cut)); parser.feed(text.slice(cut));
          outcomes.push([events, parser.retryMs]);
        }
        const events = [], parser = eventParser((kind, data) => events.push([kind, data]));
        for (const character of text) parser.feed(character);
        parser.feed("\\n");
        outcomes.push([events, parser.retryMs]);
        return outcomes;""", STREAM)
    for cut, outcome in enumerate(outcomes[:-1]):
        assert outcome == [EXPECTED, 2000], cut
    assert outcomes[-1] == [[*EXPECTED, ["message", "not ended yet"]], 2000]
