"""Issue 27, item 8: a laptop sleeps with vramguard running. On the Linux twin the whole
server (its decode workers too) is stopped with SIGSTOP for 60 s, as a sleep stops it,
while the tray follows its event stream and a request is in flight; the server's
monotonic clock then reads 60 s later at once, which is the jump a resume makes. After
SIGCONT, without a restart: the request in flight gets an answer, the server serves, its
rate limit gives the usual burst (no refusal storm, no endless credit), and the tray
shows fresh readings. The engine's own clock jumping by a night: unit/engine."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import httpx
import psutil
from images import photo
from live_server import live_server

from tray.client import ApiClient
from tray.controller import TrayController

JPEG = {"Content-Type": "image/jpeg"}
ASLEEP_S = 60


def _signal_tree(pid: int, number: int) -> None:
    process = psutil.Process(pid)
    for each in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.send_signal(number)


def test_a_minute_asleep_and_everything_carries_on(tmp_path):
    with live_server(tmp_path, "--no-cache", env={"VRAMGUARD_CLASSIFY_PER_S": "0.2",
                                                  "VRAMGUARD_CLASSIFY_BURST": "4"}) as server:
        said: list[str] = []
        with ApiClient(server.url, server.token_file) as client:
            tray = TrayController(client, notify=said.append)
            tray.follow()
            try:
                deadline = time.monotonic() + 30
                while tray.sample is None:
                    assert time.monotonic() < deadline, "the tray never got a reading"
                    tray.wait_for_news(1)
                answers: list[httpx.Response | Exception] = []

                def in_flight() -> None:
                    try:
                        answers.append(httpx.post(f"{server.url}/v1/classify",
                                                  content=photo(), headers=JPEG,
                                                  timeout=ASLEEP_S + 60))
                    except httpx.HTTPError as exc:
                        answers.append(exc)

                sender = threading.Thread(target=in_flight)
                _signal_tree(server.process.pid, signal.SIGSTOP)
                sender.start()  # sent while asleep: the kernel takes it, nobody reads it
                time.sleep(ASLEEP_S)
                resumed = time.time()
                _signal_tree(server.process.pid, signal.SIGCONT)
                sender.join(60)
                [answer] = answers
                assert isinstance(answer, httpx.Response), answer
                # served, or refused in plain words with Retry-After: never a reset or a hang
                assert answer.status_code == 200 or (
                    answer.status_code == 503 and "retry-after" in answer.headers), answer.text
                with httpx.Client(base_url=server.url, timeout=30,
                                  headers={"X-Client-Id": "after-resume"}) as fresh:
                    statuses = [fresh.post("/v1/classify", content=photo(),
                                           headers=JPEG).status_code for _ in range(6)]
                # the burst of 4 (less what refilled meanwhile), then refusals: as before
                # the sleep, neither a refusal storm nor a minute of saved-up credit
                assert statuses[:4] == [200] * 4 and 429 in statuses[4:], statuses
                deadline = time.monotonic() + 15
                while tray.sample is None or tray.sample.t < resumed:
                    assert time.monotonic() < deadline, "the tray shows no reading after resume"
                    tray.wait_for_news(1)
                assert tray.status == "running"
            finally:
                tray.stop_following()
        log = server.log_text()
    assert "Traceback" not in log, log[-3000:]
