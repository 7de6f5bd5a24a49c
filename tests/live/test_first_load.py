"""A model's first load while the appliance serves, under a CPU hog (a busy desktop): with
the default deadline the first request for each Lite model gets 200; with a 3 s deadline
every answer is 200 or 503 ``loading`` with a Retry-After, and the Python client and
``vramguard classify`` get their answers in the end by waiting for the load.

The server starts before the hog (the start measures every batch size); the profiles
start empty, so each model loaded on demand is loaded for the first time. The hog is this
test's own process, killed at the end."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import vramguard_client as vg
from images import DATA, photo
from live_server import LiveServer, live_server

ON_DEMAND = ("efficientnet_lite1", "efficientnet_lite2")
GIVE_UP_S = 90.0  # bounds each wait for a load here (a load under the hog took 2-10 s)


@contextmanager
def cpu_hog() -> Iterator[None]:
    """One process that keeps a core busy, until the block ends."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait(10)


@contextmanager
def two_servers(tmp: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    """One server with the default deadline, one with 3 s; the second reuses the first's
    profile of the --model (so it starts quickly) and nothing else."""
    first_profiles, second_profiles = tmp / "profiles-default", tmp / "profiles-3s"
    with live_server(tmp, "--log-level", "debug",
                     env={"VRAMGUARD_PROFILE_DIR": str(first_profiles)}) as default:
        shutil.copytree(first_profiles, second_profiles)  # only efficientnet_lite0's yet
        with live_server(tmp, "--request-timeout-s", "3", "--log-level", "debug",
                         env={"VRAMGUARD_PROFILE_DIR": str(second_profiles)}) as short:
            yield default, short


def classify(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/classify", params={"model": model, "top_k": 1},
                       content=photo(), headers={"Content-Type": "image/jpeg"})


def until_answered(client: httpx.Client, model: str) -> list[httpx.Response]:
    """Requests for ``model``, each after the Retry-After of a 503 before it, until 200."""
    answers: list[httpx.Response] = []
    give_up = time.monotonic() + GIVE_UP_S
    while not answers or answers[-1].status_code != 200:
        assert time.monotonic() < give_up, [(r.status_code, r.text) for r in answers]
        if answers:
            time.sleep(float(answers[-1].headers.get("retry-after", "1")))
        answers.append(classify(client, model))
    return answers


def models(client: httpx.Client) -> dict[str, dict[str, object]]:
    return {m["name"]: m for m in client.get("/v1/models").json()["models"]}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer,
                                                                       LiveServer]]:
    with two_servers(tmp_path_factory.mktemp("first-load")) as both, cpu_hog():
        yield both


def test_with_the_default_deadline_each_first_request_gets_200(servers) -> None:
    default, _ = servers
    with default.client() as client:
        for model in ("efficientnet_lite0", *ON_DEMAND):
            started = time.monotonic()
            answer = classify(client, model)
            took = time.monotonic() - started
            print(f"first request for {model} under a CPU hog: {answer.status_code} in "
                  f"{took:.1f} s")
            assert answer.status_code == 200, answer.text
            assert answer.json()["predictions"][0]["label"] == "espresso"
        listed = models(client)
        assert all(listed[m]["state"] == "loaded" for m in ON_DEMAND)


def test_with_a_3_s_deadline_the_answers_are_200_or_loading_and_clients_wait(
        servers, tmp_path: Path) -> None:
    _, short = servers
    answers: dict[str, list[httpx.Response]] = {}
    results: dict[str, object] = {}

    def raw(model: str) -> None:
        with short.client() as client:
            answers[model] = until_answered(client, model)

    def python_client() -> None:
        with vg.Client(short.url, timeout=GIVE_UP_S) as client:
            results["client"] = client.classify(DATA / "coffee.jpg", model=ON_DEMAND[0])

    def cli() -> None:
        results["cli"] = subprocess.run(
            [sys.executable, "-m", "app", "classify", str(DATA / "coffee.jpg"), "--json",
             "--model", ON_DEMAND[1], "--url", short.url, "--strict"],
            capture_output=True, text=True, timeout=GIVE_UP_S + 30)

    # Each first load is asked for by the raw requests and a client at the same time.
    for model, waiter in zip(ON_DEMAND, (python_client, cli), strict=True):
        threads = [threading.Thread(target=raw, args=(model,)), threading.Thread(target=waiter)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(GIVE_UP_S + 60)
    for model, seen in answers.items():
        print(f"{model} with a 3 s deadline under a CPU hog: "
              f"{[r.status_code for r in seen]}")
        for answer in seen[:-1]:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "loading", answer.text
            assert int(answer.headers["retry-after"]) >= 1
            assert model in answer.json()["error"]["message"]
    assert set(answers) == set(ON_DEMAND)
    client_result = results["client"]
    assert isinstance(client_result, vg.Classification)
    assert client_result.top.label == "espresso"
    done = results["cli"]
    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode == 0, done.stderr
    assert '"espresso"' in done.stdout, done.stdout
