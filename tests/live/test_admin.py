"""Admin actions, graceful shutdown, and the cap on upload bytes in flight."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import httpx
import pytest
from images import photo
from live_server import live_server

JPEG = {"Content-Type": "image/jpeg"}


def test_pause_and_resume(server):
    with server.client() as client:
        assert client.post("/v1/admin/pause").status_code == 401
        assert client.post("/v1/admin/pause", headers=server.admin()).json() == {"paused": True}
        try:
            paused = client.post("/v1/classify", content=photo(), headers=JPEG)
            assert paused.status_code == 503 and paused.json()["error"]["code"] == "paused"
            assert "Retry-After" in paused.headers
            assert client.get("/v1/stats").json()["paused"] is True
        finally:
            client.post("/v1/admin/resume", headers=server.admin())
        assert client.post("/v1/classify", content=photo(), headers=JPEG).status_code == 200


async def _fire(url: str, count: int) -> list[httpx.Response | BaseException]:
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=count)) as client:
        return await asyncio.gather(*(client.post("/v1/classify", content=photo(), headers=JPEG)
                                      for _ in range(count)), return_exceptions=True)


@pytest.mark.parametrize("how", ["sigterm", "admin"])
def test_shutdown_drains_queued_requests_and_exits_0(tmp_path, how):
    with live_server(tmp_path, "--no-cache", env={"VRAMGUARD_RATE_LIMIT": "0"}) as running:

        async def scenario() -> list[httpx.Response | BaseException]:
            burst = asyncio.ensure_future(_fire(running.url, 24))
            await asyncio.sleep(0.5)
            if how == "sigterm":
                running.process.send_signal(signal.SIGTERM)
            else:
                async with httpx.AsyncClient(base_url=running.url) as client:
                    answer = await client.post("/v1/admin/shutdown", headers=running.admin())
                    assert answer.status_code == 200
            return await burst

        results = asyncio.run(scenario())
        assert running.process.wait(30) == 0
    statuses = [r.status_code for r in results if isinstance(r, httpx.Response)]
    assert len(statuses) == 24, [r for r in results if not isinstance(r, httpx.Response)]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 1
    assert "Traceback" not in running.log_text()


def test_upload_bytes_in_flight_are_capped_as_they_arrive(tmp_path):
    with live_server(tmp_path, "--no-cache",
                     env={"VRAMGUARD_MAX_INFLIGHT_BODY_BYTES": "1MiB"}) as running:
        port = int(running.url.rsplit(":", 1)[1])
        slow = socket.create_connection(("127.0.0.1", port))
        try:  # 600 kB of 800 kB received: the next 800 kB upload passes 1 MiB on its way
            slow.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                         b"Content-Type: image/jpeg\r\nContent-Length: 800000\r\n\r\n" % port
                         + bytes(600_000))
            time.sleep(0.3)
            with running.client() as client:
                refused = client.post("/v1/classify", content=bytes(800_000), headers=JPEG)
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "overloaded"
                assert refused.headers["Retry-After"] == "1"
        finally:
            slow.close()
        time.sleep(0.3)
        with running.client() as client:
            assert client.post("/v1/classify", content=photo(), headers=JPEG).status_code == 200
