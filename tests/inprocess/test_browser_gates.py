"""What a web page in the user's browser (or a local program) could do to the shared
buckets and the live-view slots, in process: the Origin-less cross-site GET drain,
Sec-Fetch-Site refusals, the /v1/events overshoot and per-client cap, the global read and
admin buckets, authentication before the admin bucket, /ui framing, and cors_origins."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from asgi import (
    built_app,
    client,
    error_message,
    png,
    state_of,
    until,
)
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.events import EventStream
from app.config import ConfigError, load_settings
from app.http.live_feed import KEPT, MAX_STREAMS_PER_CLIENT, MAX_SUBSCRIBERS, LiveFeed
from app.http.scope import route_exists

pytestmark = pytest.mark.anyio
PNG = {"Content-Type": "image/png"}
LISTED = "http://localhost:3000"
# What a browser adds to an <img src="http://127.0.0.1:8765/..."> on another site: no Origin.
IMAGE_FROM_ANOTHER_SITE = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors",
                           "Sec-Fetch-Dest": "image"}


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    with built_app(tmp_path, ready=True, cors_origins=[LISTED]) as app:
        yield app


def admin(app: FastAPI) -> dict[str, str]:
    return {"Authorization": f"Bearer {state_of(app).admin_token.current()}"}


# --- the Origin-less cross-site GET drain --------------------------------------------------


@pytest.mark.parametrize("headers", [IMAGE_FROM_ANOTHER_SITE, {}],
                         ids=["sec-fetch", "old-browser"])
async def test_an_origin_less_cross_site_get_drain_costs_no_classify_token(
        app: FastAPI, headers: dict[str, str]) -> None:
    """110 no-cors GETs of /v1/classify (a page's <img> tags; an old browser sends no
    Sec-Fetch-* either) are refused or 405, and a local app without X-Client-Id, which
    shares the browser's bucket, still classifies."""
    async with client(app) as http:
        drain = [await http.get("/v1/classify", headers=headers) for _ in range(110)]
        local_app = await http.post("/v1/classify", content=png(), headers=PNG)
    assert {a.status_code for a in drain} == ({403} if headers else {405})
    assert local_app.status_code == 200, local_app.text
    assert state_of(app).limiter.rejected == 0


async def test_a_404_or_405_costs_no_read_token(tmp_path: Path) -> None:
    with built_app(tmp_path, read_burst=3, read_per_s=0.001) as app:
        async with client(app) as http:
            for _ in range(10):
                assert (await http.get("/v1/nowhere")).status_code == 404
                assert (await http.post("/v1/stats")).status_code == 405
                assert (await http.head("/healthz")).status_code == 405
            answers = [await http.get("/v1/stats") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]


def test_every_route_is_charged_and_nothing_else(app: FastAPI) -> None:
    """Whether a route exists is asked of the app's own router (FastAPI's included
    routers): if that stopped working, every request would be free."""

    def scope(method: str, path: str) -> Scope:
        return {"type": "http", "method": method, "path": path, "root_path": "",
                "headers": [], "query_string": b"", "app": app}

    routes = [(method.upper(), path) for path, item in app.openapi()["paths"].items()
              for method in item]
    assert ("POST", "/v1/classify") in routes and len(routes) > 12
    assert all(route_exists(scope(*route)) for route in routes)
    for method, path in [("GET", "/v1/classify"), ("GET", "/v1/nowhere"),
                         ("HEAD", "/healthz"), ("OPTIONS", "/v1/classify")]:
        assert not route_exists(scope(method, path))


# --- Sec-Fetch-Site --------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "headers"), [
    ("GET", "/v1/stats", IMAGE_FROM_ANOTHER_SITE),
    ("GET", "/v1/events", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors",
                           "Sec-Fetch-Dest": "script"}),
    ("POST", "/v1/classify", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors",
                              "Sec-Fetch-Dest": "empty"}),
    # a page on another port of this computer (http://127.0.0.1:3000) is same-site
    ("GET", "/v1/memory", {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors",
                           "Sec-Fetch-Dest": "image"}),
    ("GET", "/ui", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
                    "Sec-Fetch-Dest": "iframe"}),
    ("GET", "/v1/stats", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
                          "Sec-Fetch-Dest": "document"}),
    ("GET", "/v1/stats", {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors",
                          "Sec-Fetch-Dest": "empty", "Origin": "http://127.0.0.1:3000"}),
], ids=["img", "script-events", "form-classify", "same-site-img", "ui-in-a-frame",
        "navigate-to-api", "unlisted-same-site"])
async def test_requests_from_other_sites_are_refused(app: FastAPI, method: str, path: str,
                                                     headers: dict[str, str]) -> None:
    async with client(app) as http:  # a stream let through would never end: bounded
        response = await asyncio.wait_for(http.request(method, path, headers=headers), 5)
        stats = await http.get("/v1/stats", headers={"X-Client-Id": "monitor"})
    assert "web page" in error_message(response, 403, "forbidden")
    assert stats.json()["requests"] == {"forbidden": 1}


@pytest.mark.parametrize("headers", [
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"},
    {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"},
    {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "navigate",
     "Sec-Fetch-Dest": "document"},
], ids=["link-from-a-file", "typed", "reload"])
async def test_opening_the_dashboard_from_anywhere_works(app: FastAPI,
                                                         headers: dict[str, str]) -> None:
    async with client(app) as http:
        response = await http.get("/ui", headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("headers", [
    {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"},
    {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty",
     "Origin": LISTED},
    {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty",
     "Origin": LISTED},
], ids=["the-dashboard", "listed-same-site", "listed-cross-site"])
async def test_our_pages_and_listed_origins_pass(app: FastAPI, headers: dict[str, str]) -> None:
    async with client(app) as http:
        response = await http.get("/v1/stats", headers=headers)
    assert response.status_code == 200, response.text


# --- /v1/events -----------------------------------------------------------------------------


def recording(app: ASGIApp, statuses: list[int]) -> ASGIApp:
    """``app``, noting the status of each answer as soon as it starts (a stream's answer
    never ends on its own)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        await app(scope, receive, watch)

    return wrapped


async def open_streams(app: FastAPI, client_ids: list[str]) -> list[int]:
    """Open one /v1/events per id, all at once; their statuses once every one has
    answered. The streams are ended afterwards by closing the hub."""
    statuses: list[int] = []
    async with client(recording(app, statuses)) as http:
        opening = [asyncio.ensure_future(http.get(
            "/v1/events", headers={"X-Client-Id": client_id} if client_id else {}))
            for client_id in client_ids]
        try:
            await until(lambda: len(statuses) == len(client_ids))
        finally:
            state_of(app).feed.close()
            done = await asyncio.gather(*opening, return_exceptions=True)
    assert all(isinstance(d, httpx.Response) for d in done), done
    return statuses


async def test_forty_concurrent_streams_do_not_overshoot_the_limit(app: FastAPI) -> None:
    """The slot is taken in the handler, not when the stream first runs: 40 at once from
    40 clients get the 30 streams not kept for the tray and the dashboard, and the rest
    503."""
    statuses = await open_streams(app, [f"viewer-{i}" for i in range(40)])
    open_to_anyone = MAX_SUBSCRIBERS - len(KEPT)
    assert statuses.count(200) == open_to_anyone and statuses.count(503) == 40 - open_to_anyone
    assert not state_of(app).feed.subscribers


async def test_one_client_cannot_take_every_stream(app: FastAPI) -> None:
    """40 at once from one client (a page, a program without X-Client-Id) get
    MAX_STREAMS_PER_CLIENT; the tray, another client, still gets its own."""
    statuses = await open_streams(app, [""] * 40 + ["vramguard-tray"])
    assert statuses.count(200) == MAX_STREAMS_PER_CLIENT + 1
    assert statuses.count(503) == 40 - MAX_STREAMS_PER_CLIENT


async def test_a_refused_stream_says_why(tmp_path: Path) -> None:
    with built_app(tmp_path) as app:
        hub = state_of(app).feed
        held = [hub.subscribe("127.0.0.1") for _ in range(MAX_STREAMS_PER_CLIENT)]
        async with client(app) as http:
            mine = await http.get("/v1/events")
            for i in range(MAX_SUBSCRIBERS - len(KEPT) - MAX_STREAMS_PER_CLIENT):
                held.append(hub.subscribe(f"other-{i}"))
            anyone = await http.get("/v1/events", headers={"X-Client-Id": "dashboard"})
        for subscriber in held:
            hub.release(subscriber)
    assert "This program" in error_message(mine, 503, "overloaded")
    assert "Too many live views" in error_message(anyone, 503, "overloaded")
    assert mine.headers["Retry-After"] == anyone.headers["Retry-After"] == "5"
    assert not hub.subscribers


async def test_a_stream_that_never_started_gives_its_slot_back() -> None:
    """The client left before the answer began: the stream's generator never ran, and
    the slot taken in the handler is given back all the same."""
    hub = LiveFeed()
    stream = EventStream(hub, hub.subscribe("a"))

    async def gone(message: Message) -> None:
        raise OSError("the client has gone")

    async def never() -> Message:
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    with pytest.raises(Exception, match="gone"):
        await stream({"type": "http", "method": "GET", "path": "/v1/events",
                      "headers": []}, never, gone)
    assert not hub.subscribers


# --- global buckets, authentication before the admin bucket --------------------------------


async def test_token_less_admin_calls_cannot_starve_the_tray(app: FastAPI) -> None:
    """Calls without the token, even under the tray's own X-Client-Id, are charged to
    their own buckets: the tray, which sends the token, is never refused."""
    tray = {"X-Client-Id": "vramguard-tray"}
    async with client(app) as http:
        token_less = [await http.post("/v1/admin/pause", headers=tray) for _ in range(40)]
        named = [await http.post("/v1/admin/pause", headers={"X-Client-Id": f"app-{i}"})
                 for i in range(40)]
        answer = await http.post("/v1/admin/resume", headers={**tray, **admin(app)})
    assert answer.status_code == 200, answer.text
    assert {a.status_code for a in token_less} == {401, 429}
    assert {a.status_code for a in named} == {401, 429}  # the global admin bucket


async def test_token_less_calls_cannot_keep_the_dashboard_from_signing_in(
        app: FastAPI) -> None:
    """The handshakes made before a caller can authenticate cost nothing: a program
    sharing the browser's address cannot spend the dashboard's sign-in."""
    async with client(app) as http:
        flood = [await http.post("/v1/ui/session", json={"code": f"guess-{i}"})
                 for i in range(40)]
        flood += [await http.post("/v1/admin/pause") for _ in range(40)]
        code = state_of(app).ui_sessions.new_code()
        sign_in = await http.post("/v1/ui/session", json={"code": code})
    assert 429 not in {a.status_code for a in flood[:40]}
    assert sign_in.status_code == 200, sign_in.text


async def test_the_global_read_bucket_spares_health_checks_the_tray_and_the_token(
        tmp_path: Path) -> None:
    with built_app(tmp_path, global_read_burst=5, global_read_per_s=0.001) as app:
        async with client(app) as http:
            flood = [await http.get("/v1/stats", headers={"X-Client-Id": f"app-{i}"})
                     for i in range(8)]
            health = [await http.get(path, headers={"X-Client-Id": "supervisor"})
                      for path in ("/healthz", "/readyz")]
            tray = await http.get("/v1/stats", headers={"X-Client-Id": "vramguard-tray",
                                                        **admin(app)})
        live_line = await open_streams(app, ["vramguard-tray"])
    assert [a.status_code for a in flood] == [200] * 5 + [429] * 3
    assert [a.status_code for a in health] == [200, 503]  # 503: not ready, but not 429
    assert tray.status_code == 200
    assert live_line == [200]  # bounded by its slots, not by the global bucket


async def test_the_global_admin_bucket_bounds_token_less_calls(tmp_path: Path) -> None:
    with built_app(tmp_path, global_admin_burst=3, global_admin_per_s=0.001) as app:
        async with client(app) as http:
            answers = [await http.post("/v1/admin/shutdown",
                                       headers={"X-Client-Id": f"guess-{i}"})
                       for i in range(5)]
            tray = await http.post("/v1/admin/ui-link", headers=admin(app))
    assert [a.status_code for a in answers] == [401] * 3 + [429] * 2
    assert tray.status_code == 200


# --- /ui framing, cors_origins --------------------------------------------------------------


async def test_the_dashboard_cannot_be_framed(app: FastAPI) -> None:
    async with client(app) as http:
        response = await http.get("/ui")
    policy = [part.strip() for part in response.headers["Content-Security-Policy"].split(";")]
    assert "frame-ancestors 'none'" in policy
    assert "default-src 'self'" in policy  # merged with the page's own policy
    assert response.headers["X-Frame-Options"] == "DENY"


@pytest.mark.parametrize("origins", [["*"], ["null"], [LISTED, "null"], ["localhost:3000"],
                                     ["http://localhost:3000/ui"]])
def test_cors_origins_that_would_let_any_page_in_are_refused(origins: list[str]) -> None:
    with pytest.raises(ConfigError, match="'cors_origins'") as refused:
        load_settings(cors_origins=origins)
    assert "http://localhost:3000" in str(refused.value)  # says what to write instead


def test_listed_origins_are_kept() -> None:
    settings = load_settings(cors_origins=[LISTED, "https://app.example:8443"])
    assert settings.cors_origins == [LISTED, "https://app.example:8443"]


async def test_a_429_reaches_a_listed_page_with_its_cors_header_and_readable_retry_after(
        tmp_path: Path) -> None:
    """Without it the page sees a network error instead of the 429, and cannot read how
    long to wait: its client would retry blindly, sooner than the server asked."""
    page = {"Origin": LISTED, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}
    with built_app(tmp_path, ready=True, cors_origins=[LISTED], read_burst=1,
                   read_per_s=0.01) as app:
        async with client(app) as http:
            answers = [await http.get("/v1/stats", headers=page) for _ in range(3)]
    refused = answers[-1]
    assert refused.status_code == 429
    assert refused.headers["access-control-allow-origin"] == LISTED
    exposed = {h.strip().lower() for h in
               refused.headers["access-control-expose-headers"].split(",")}
    assert {"retry-after", "ratelimit-reset"} <= exposed
