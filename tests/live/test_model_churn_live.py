"""Model churn as the attack, on a real server on 127.0.0.1 with the real models: one app
keeps efficientnet_lite1 for an hour; a program looping ``?model=…&keep_alive=0`` (and
``-1``, and bodiless ``/v2`` requests for another model) is served but unloads nothing
and loads nothing, so the other app's next load, within a limit of 2 loads a minute,
still succeeds. Bounded: 8 requests of the loop, 2 loads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from images import photo
from live_server import live_server

LITE1, LITE2 = "efficientnet_lite1", "efficientnet_lite2"
HEADER = "X-Vramguard-Keep-Alive"
IGNORED = "ignored; shorter stays and -1 need the admin token"
ENV = {"VRAMGUARD_MAX_BATCH_SIZE": "1", "VRAMGUARD_MAX_LOADS_PER_MINUTE": "2",
       "VRAMGUARD_REQUEST_TIMEOUT_S": "60"}


def classify(client: httpx.Client, app: str, model: str, **params: Any) -> httpx.Response:
    return client.post("/v1/classify", params={"model": model, **params}, content=photo(),
                       headers={"Content-Type": "image/jpeg", "X-Client-Id": app})


def listed(client: httpx.Client, name: str) -> dict[str, Any]:
    models = client.get("/v1/models").json()["models"]
    return next(m for m in models if m["name"] == name)


def test_a_churning_program_cannot_unload_a_model_nor_use_up_the_loads(tmp_path: Path
                                                                        ) -> None:
    with live_server(tmp_path, "--no-cache", env=ENV) as server, server.client() as client:
        kept = classify(client, "photos-app", LITE1, keep_alive=3600)
        assert kept.status_code == 200, kept.text
        for keep_alive in (0, 0, 0, 0, 0, 0, -1):
            churn = classify(client, "churner", LITE1, keep_alive=keep_alive)
            assert churn.status_code == 200, churn.text
            assert churn.headers[HEADER] == IGNORED
        bodiless = client.post(f"/v2/models/{LITE2}/infer",
                               headers={"Content-Type": "application/json",
                                        "X-Client-Id": "churner"})
        assert bodiless.status_code == 400, bodiless.text
        time.sleep(1.5)  # an unload would have been queued and done by now (a tick)
        model = listed(client, LITE1)
        assert model["state"] == "loaded" and model["keep_alive_s"] == 3600
        assert listed(client, LITE2)["state"] == "available"

        other = classify(client, "photos-app", LITE2)  # the second load of this minute
        assert other.status_code == 200, other.text
        assert other.json()["model"] == LITE2
