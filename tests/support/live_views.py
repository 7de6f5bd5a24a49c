"""Every open live-view slot of a real server taken, as a program that rotates client
ids takes them: what the tray's and the dashboard's kept slots must withstand."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from app.http.live_feed import MAX_SUBSCRIBERS


@contextmanager
def open_slots_taken(url: str) -> Iterator[int]:
    """Streams opened, each as a client of its own (one client may hold only a few),
    until the server refuses one more; closed at the end. Yields how many it holds."""
    with httpx.Client(base_url=url, timeout=10) as client:
        views: list[httpx.Response] = []
        try:
            for i in range(2 * MAX_SUBSCRIBERS):
                request = client.build_request("GET", "/v1/events",
                                               headers={"X-Client-Id": f"viewer-{i}"})
                response = client.send(request, stream=True)
                if response.status_code == 503:
                    response.close()
                    break
                views.append(response)
            else:
                pytest.fail("the server never refused a stream")
            yield len(views)
        finally:
            for response in views:
                response.close()
