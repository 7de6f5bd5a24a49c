"""Localhost security and rate limiting against a real server."""

from __future__ import annotations

import pytest
from images import photo
from live_server import live_server

JPEG = {"Content-Type": "image/jpeg"}


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "127.0.0.1:1",
                                  "localhost.evil.example"])
def test_foreign_host_header_is_403(server, host):
    with server.client() as client:
        response = client.get("/v1/models", headers={"Host": host})
        assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden"
        classify = client.post("/v1/classify", content=photo(), headers={**JPEG, "Host": host})
        assert classify.status_code == 403


def test_our_own_names_are_accepted(server):
    port = server.url.rsplit(":", 1)[1]
    with server.client() as client:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            assert client.get("/healthz", headers={"Host": host}).status_code == 200


def test_foreign_origin_is_403_even_for_simple_requests(server):
    with server.client() as client:
        for origin in ("https://evil.example", "null", "http://localhost:3000"):
            response = client.post("/v1/classify", content=photo(),
                                   headers={**JPEG, "Origin": origin})
            assert response.status_code == 403, origin
            assert "access-control-allow-origin" not in response.headers
        own = client.post("/v1/classify", content=photo(),
                          headers={**JPEG, "Origin": server.url})
        assert own.status_code == 200  # the /docs page's "try it out"


def test_configured_origin_gets_cors_headers(tmp_path):
    origin = "http://localhost:3000"
    with live_server(tmp_path, "--no-cache", env={"VRAMGUARD_CORS_ORIGINS": f'["{origin}"]'}) \
            as served, served.client() as client:
        preflight = client.options("/v1/classify", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        response = client.post("/v1/classify", content=photo(), headers={**JPEG, "Origin": origin})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
        assert client.get("/healthz", headers={"Origin": "http://evil.example"}).status_code \
            == 403


def test_rate_limit_gives_429_with_retry_after(tmp_path):
    env = {"VRAMGUARD_CLASSIFY_BURST": "3", "VRAMGUARD_CLASSIFY_PER_S": "0.5"}
    with live_server(tmp_path, env=env) as limited, limited.client() as client:
        answers = [client.post("/v1/classify", content=photo(), headers=JPEG)
                   for _ in range(5)]
        assert [r.status_code for r in answers] == [200, 200, 200, 429, 429]
        ok, refused = answers[0], answers[3]
        assert ok.headers["RateLimit-Limit"] == "3"
        assert int(ok.headers["RateLimit-Remaining"]) == 2
        assert refused.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(refused.headers["Retry-After"]) <= 2
        assert refused.headers["RateLimit-Remaining"] == "0"
        other_app = client.post("/v1/classify", content=photo(),
                                headers={**JPEG, "X-Client-Id": "other-app"})
        assert other_app.status_code == 200  # its own bucket
        assert client.get("/v1/stats").json()["rate_limited"] == 2
        spoofed = client.post("/v1/classify", content=photo(),
                              headers={**JPEG, "X-Forwarded-For": "10.9.9.9"})
        assert spoofed.status_code == 429  # a made-up address is not a fresh bucket
    assert '"POST /v1/classify HTTP/1.1" 429' not in limited.log.read_text()  # no access log
