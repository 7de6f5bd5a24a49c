"""The tray's models section, without a display or a server: the words for each loaded
model, the menu built from a sample with two models (one kept loaded), the menu rebuilt
when the models change, and Unload going through the authenticated client to the right
endpoint, with kind words for a busy model (409) or one already gone (404).

The server is a stand-in on httpx's MockTransport that answers the identity challenge
the way vramguard does (``identity_proof``) and records every request."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from samples import sample

from app.host.token_file import identity_proof, load_or_create_token
from app.schemas import LiveSample
from tray.app import TrayView, build_menu, load_pystray
from tray.client import ApiClient
from tray.controller import TrayController
from tray.text import MODELS_HEADING, model_entries

MiB = 1024**2
PORT = 8799
LITE0 = {"name": "efficientnet_lite0", "weights_bytes": 18 * MiB,
         "batch_peak_bytes": 120 * MiB, "batch_size": 4, "pinned": True}
LITE1 = {"name": "efficientnet_lite1", "weights_bytes": 21 * MiB,
         "batch_peak_bytes": 160 * MiB, "batch_size": 4, "pinned": False}
STATS = {"uptime_s": 10.0, "phase": "ready", "paused": False, "queue_depth": 0,
         "in_flight": 0, "batches": 0, "batched_images": 0, "mean_batch_size": 0.0,
         "largest_batch": 0, "expired_in_queue": 0, "withdrawn_in_queue": 0, "requests": {},
         "rate_limited": 0, "cache_entries": None}


def two_models() -> LiveSample:
    return sample(models=[LITE0, LITE1])


class FakeServer:
    """What vramguard answers to the tray's calls; ``unload_status`` for the unload."""

    def __init__(self, token: str, unload_status: int = 200) -> None:
        self.token = token
        self.unload_status = unload_status
        self.loaded = [LITE0, LITE1]
        self.requests: list[tuple[str, str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append((request.method, path, request.headers.get("Authorization")))
        if path == "/v1/identity":
            nonce = bytes.fromhex(json.loads(request.content)["nonce"])
            proof = identity_proof(self.token, nonce, "127.0.0.1", PORT)
            return httpx.Response(200, json={"proof": proof})
        if path.startswith("/v1/models/") and path.endswith("/unload"):
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                return error(401, "unauthorized", "An admin token is needed.")
            name = path.split("/")[3]
            if self.unload_status == 409:
                return error(409, "conflict", f"The model {name} has images waiting or in "
                             "progress; try again when they are done.")
            if self.unload_status == 404 or name not in [m["name"] for m in self.loaded]:
                return error(404, "not_found", f"The model {name} is not loaded.")
            self.loaded = [m for m in self.loaded if m["name"] != name]
            return httpx.Response(200, json={"unloaded": name})
        if path == "/v1/memory":
            return httpx.Response(200, json=sample(models=self.loaded).model_dump(mode="json"))
        if path == "/v1/stats":
            return httpx.Response(200, json=STATS)
        return error(404, "not_found", "No such path.")

    def unloads(self) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[1].endswith("/unload")]


def error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


class Icon:
    """pystray's icon, as far as a menu action uses it."""

    HAS_NOTIFICATION = True

    def __init__(self) -> None:
        self.said: list[str] = []
        self.menus = 0

    def notify(self, message: str, _title: str = "") -> None:
        self.said.append(message)

    def update_menu(self) -> None:
        self.menus += 1


@pytest.fixture
def pystray(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("PYSTRAY_BACKEND", "dummy")
    return load_pystray()


def tray(tmp_path: Path, unload_status: int = 200) -> tuple[TrayController, FakeServer]:
    token_file = tmp_path / "admin-token"
    server = FakeServer(load_or_create_token(token_file), unload_status)
    client = ApiClient(f"http://127.0.0.1:{PORT}", token_file,
                       transport=httpx.MockTransport(server))
    controller = TrayController(client, notify=lambda _message: None)
    controller.stream_sample(two_models())
    return controller, server


def texts(menu: Any) -> list[str]:
    return [item.text for item in menu]  # the visible items, separators as '- - - -'


def test_each_loaded_model_in_plain_words():
    entries = model_entries(two_models())
    assert [(e.name, e.label, e.unload) for e in entries] == [
        ("efficientnet_lite0",
         "efficientnet_lite0 — 18 MiB (+ 120 MiB while working), kept loaded",
         "Unload (frees 18 MiB)"),
        ("efficientnet_lite1",
         "efficientnet_lite1 — 21 MiB (+ 160 MiB while working)",
         "Unload (frees 21 MiB)"),
    ]
    assert model_entries(None) == []
    assert model_entries(sample()) == []  # no model listed: no section


def test_an_own_model_says_what_it_is_and_a_built_in_one_does_not():
    """An own model's line names it 'your model', with its format and what it answers;
    a built-in one (torchvision's too, though an own model may have that format) reads
    as before."""
    own = {"weights_bytes": 4 * MiB, "batch_peak_bytes": 20 * MiB, "batch_size": 8,
           "pinned": False, "own": True}
    models = [{**own, "name": "shapes", "task": "classify", "format": "onnx", "labels": 3},
              {**own, "name": "tags", "task": "multilabel", "format": "timm", "labels": 12},
              {**own, "name": "faces", "task": "embed", "format": "onnx", "labels": 0},
              {**own, "name": "one", "task": "classify", "format": "torchvision",
               "labels": 1},
              {**LITE1, "task": "classify", "format": "efficientnet_lite", "labels": 1000},
              {**own, "name": "resnet18", "task": "classify", "format": "torchvision",
               "labels": 1000, "own": False}]
    assert [e.label for e in model_entries(sample(models=models))] == [
        "shapes — your model (onnx, 3 labels), 4 MiB (+ 20 MiB while working)",
        "tags — your model (timm, multilabel, 12 labels), 4 MiB (+ 20 MiB while working)",
        "faces — your model (onnx, image features), 4 MiB (+ 20 MiB while working)",
        "one — your model (torchvision, 1 label), 4 MiB (+ 20 MiB while working)",
        "efficientnet_lite1 — 21 MiB (+ 160 MiB while working)",
        "resnet18 — 4 MiB (+ 20 MiB while working)",
    ]


def test_the_menu_lists_the_models_each_with_its_unload(tmp_path, pystray):
    controller, _ = tray(tmp_path)
    menu = build_menu(pystray, controller, threading.Event())
    shown = texts(menu)
    heading = shown.index(MODELS_HEADING)
    assert shown[heading - 1] == "- - - -"  # after the readings, set apart from them
    assert shown[heading + 1:heading + 4] == [
        "efficientnet_lite0 — 18 MiB (+ 120 MiB while working), kept loaded",
        "efficientnet_lite1 — 21 MiB (+ 160 MiB while working)",
        "- - - -"]
    assert shown[heading + 4] == "Empty GPU cache"
    items = list(menu)
    assert not items[heading].enabled  # the heading is a reading, not an action
    submenus = [items[heading + 1].submenu, items[heading + 2].submenu]
    assert [texts(sub) for sub in submenus] == [["Unload (frees 18 MiB)"],
                                               ["Unload (frees 21 MiB)"]]
    assert all(item.enabled for sub in submenus for item in sub)


def test_no_models_section_while_the_server_is_down(tmp_path, pystray):
    controller, _ = tray(tmp_path)
    controller.stream_lost("connection refused")
    shown = texts(build_menu(pystray, controller, threading.Event()))
    assert MODELS_HEADING not in shown
    assert not any("efficientnet" in text for text in shown)


def test_unload_calls_the_endpoint_with_the_token_and_the_menu_follows(tmp_path, pystray):
    controller, server = tray(tmp_path)
    token = load_or_create_token(tmp_path / "admin-token")
    menu = build_menu(pystray, controller, threading.Event())
    lite1 = next(item for item in menu if item.text.startswith("efficientnet_lite1"))
    icon = Icon()
    next(iter(lite1.submenu))(icon)  # click "Unload (frees 21 MiB)"
    assert server.unloads() == [("POST", "/v1/models/efficientnet_lite1/unload",
                                 f"Bearer {token}")]
    before = server.requests.index(server.unloads()[0])
    assert server.requests[before - 1][:2] == ("POST", "/v1/identity")  # proof first
    assert server.requests[before - 1][2] is None  # and no token sent with the challenge
    assert icon.said == ["efficientnet_lite1 is no longer in memory (21 MiB freed). It "
                         "loads again the next time an image asks for it."]
    shown = texts(menu)  # rebuilt from the reading taken right after the action
    assert not any(text.startswith("efficientnet_lite1") for text in shown)
    assert any(text.startswith("efficientnet_lite0") for text in shown)


def test_a_busy_model_is_refused_in_plain_words(tmp_path):
    controller, server = tray(tmp_path, unload_status=409)
    message = controller.unload("efficientnet_lite1")
    assert message == ("efficientnet_lite1 is working on images right now, so it stays in "
                       "memory. Try again when they are done.")
    assert len(server.unloads()) == 1
    assert [e.name for e in controller.models()] == ["efficientnet_lite0",
                                                     "efficientnet_lite1"]


def test_a_model_already_gone_is_said_plainly(tmp_path):
    controller, _ = tray(tmp_path, unload_status=404)
    assert controller.unload("efficientnet_lite1") == (
        "efficientnet_lite1 was not in memory any more: there was nothing to unload.")


def test_a_server_that_cannot_prove_itself_gets_no_unload(tmp_path):
    controller, server = tray(tmp_path)
    server.token = "another-token"  # passes no challenge: nothing is sent
    message = controller.unload("efficientnet_lite1")
    assert message.startswith("Could not do that: Another program is answering on port")
    assert server.unloads() == []
    assert "Traceback" not in message


def test_the_menu_is_rebuilt_when_the_models_change(tmp_path):
    controller, _ = tray(tmp_path)
    view, icon = TrayView(controller), Icon()
    view.show(icon)
    view.show(icon)
    assert icon.menus == 1
    controller.stream_sample(sample(models=[LITE0]))  # the readings are the same
    view.show(icon)
    assert icon.menus == 2
