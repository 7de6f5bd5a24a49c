"""The Python client (clients/python, import vramguard_client): discovery, calls, errors,
retries, all answered through httpx.MockTransport (against real servers:
live/test_client_python_live.py)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import vramguard_client as vg
from live_server import ROOT
from PIL import Image
from vramguard_client._protocol import proven_origin

from bench.process import free_port

Handler = Callable[[httpx.Request], httpx.Response]
CODES = {  # every code vramguard answers (README's errors table), with its exception
    "bad_image": (400, vg.BadImage), "bad_request": (400, vg.BadRequest),
    "unauthorized": (401, vg.Unauthorized), "forbidden": (403, vg.Forbidden),
    "not_found": (404, vg.NotFound), "method_not_allowed": (405, vg.MethodNotAllowed),
    "request_timeout": (408, vg.RequestTimeout), "conflict": (409, vg.Conflict),
    "payload_too_large": (413, vg.PayloadTooLarge), "image_too_large": (413, vg.ImageTooLarge),
    "unsupported_media_type": (415, vg.UnsupportedMediaType),
    "image_too_complex": (422, vg.ImageTooComplex), "rate_limited": (429, vg.RateLimited),
    "client_closed": (499, vg.ClientClosed), "internal_error": (500, vg.InternalError),
    "overloaded": (503, vg.Overloaded), "deadline_exceeded": (503, vg.DeadlineExceeded),
    "paused": (503, vg.Paused), "not_ready": (503, vg.NotReady),
    "loading": (503, vg.Loading), "insufficient_memory": (503, vg.InsufficientMemory),
}
ANSWER = {"model": "efficientnet_lite0", "batch_size": 1, "cached": False,
          "predictions": [{"label": "espresso", "index": 967, "score": 0.95}],
          "timing_ms": {"total": 30.0}}
def error(code: str, headers: dict[str, str] | None = None) -> httpx.Response:
    status = CODES[code][0]
    return httpx.Response(status, headers=headers,
                          json={"error": {"code": code, "message": f"the server says {code}"}})


def mock(handler: Handler, **kwargs: Any) -> vg.Client:
    return vg.Client("http://127.0.0.1:8765", transport=httpx.MockTransport(handler), **kwargs)


class Script:
    """A mock server that answers from a list, recording when each request came."""

    def __init__(self, *answers: httpx.Response) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[float, httpx.Request]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((time.monotonic(), request))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def gaps(self) -> list[float]:
        times = [t for t, _ in self.requests]
        return [b - a for a, b in itertools.pairwise(times)]


# --- no PyTorch -------------------------------------------------------------------------

def test_import_brings_in_neither_torch_nor_numpy_nor_the_server(tmp_path):
    code = ("import sys, json, vramguard_client; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    source = str(ROOT / "clients" / "python")  # installed or not; the repo is not on the path
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": source})
    loaded = set(json.loads(out.stdout))
    assert "httpx" in loaded
    assert not loaded & {"torch", "torchvision", "numpy", "app", "tray", "PIL", "pydantic"}


# --- discovery --------------------------------------------------------------------------

def config_home() -> Path:
    return Path(os.environ["XDG_CONFIG_HOME"]) / "vramguard"


def test_without_anything_it_is_the_default_port():
    found = vg.find_server()
    assert (found.url, found.source) == ("http://127.0.0.1:8765", "default")
    assert found.token_file == config_home() / "admin-token"


def test_config_file_then_environment(tmp_path, monkeypatch):
    config_home().mkdir(parents=True)
    (config_home() / "config.toml").write_text(
        f'port = 9123\nhost = "0.0.0.0"\ntoken_file = "{tmp_path / "tok"}"\n')
    found = vg.find_server()
    assert (found.url, found.source, found.token_file) == \
        ("http://127.0.0.1:9123", "config", tmp_path / "tok")
    monkeypatch.setenv("VRAMGUARD_PORT", "9200")
    assert vg.find_server().url == "http://127.0.0.1:9200"
    other = tmp_path / "other.toml"
    other.write_text('port = 9300\nhost = "::1"\n')
    monkeypatch.delenv("VRAMGUARD_PORT")
    monkeypatch.setenv("VRAMGUARD_CONFIG", str(other))
    assert vg.find_server().url == "http://[::1]:9300"  # never the other family
    assert vg.find_server("http://10.0.0.5:1234/").url == "http://10.0.0.5:1234"


@contextlib.contextmanager
def instance(folder: Path, port: int, held: bool) -> Iterator[None]:
    """What a vramguard on ``port`` writes about itself; ``held``: it is still running."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / f"instance-{port}.json").write_text(json.dumps(
        {"pid": 1, "port": port, "url": f"http://127.0.0.1:{port}"}))
    with open(folder / f"instance-{port}.lock", "w") as lock:
        if held:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def test_a_running_instance_comes_before_the_config(monkeypatch):
    monkeypatch.setenv("VRAMGUARD_PORT", "9001")
    run = config_home() / "run"
    with instance(run, 9400, held=False):  # a crashed server's leftovers
        assert vg.find_server().source == "config"
        with instance(run, 9500, held=True), instance(run, 9001, held=True):
            assert vg.find_server().url == "http://127.0.0.1:9001"  # the configured port
        with instance(run, 9500, held=True):
            found = vg.find_server()
            assert (found.url, found.source) == ("http://127.0.0.1:9500", "instance")


def test_a_found_server_that_moved_is_followed():
    """Started with nothing running (the default port), the client follows vramguard to
    the port its instance file names once nothing answers where it was."""

    def on_9500_only(request: httpx.Request) -> httpx.Response:
        if request.url.port != 9500:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"models": []})

    with vg.Client(transport=httpx.MockTransport(on_9500_only)) as client:
        assert client.location.source == "default"
        with instance(config_home() / "run", 9500, held=True):
            assert client.models() == []
        assert (client.url, client.location.source) == ("http://127.0.0.1:9500", "instance")


# --- errors and retries, through a mock transport ---------------------------------------

@pytest.mark.parametrize("code", sorted(CODES))
def test_each_error_code_has_its_exception(code):
    status, cls = CODES[code]
    with mock(Script(error(code, {"Retry-After": "3"})), max_retries=0) as client, \
            pytest.raises(cls) as raised:
        client.classify(b"x")
    assert (raised.value.code, raised.value.status) == (code, status)
    assert raised.value.message == f"the server says {code}"
    assert raised.value.retry_after == 3
    assert isinstance(raised.value, vg.VramguardError)
    assert isinstance(raised.value, vg.Unavailable) == (status == 503)


def test_an_unknown_code_and_a_foreign_answer():
    answer = httpx.Response(418, json={"error": {"code": "teapot", "message": "short"}})
    with mock(Script(answer)) as client, pytest.raises(vg.VramguardError) as raised:
        client.memory()
    assert (raised.value.code, raised.value.status, raised.value.message) == \
        ("teapot", 418, "short")
    with mock(Script(httpx.Response(502, text="<html>bad gateway"))) as client, \
            pytest.raises(vg.UnexpectedResponse, match="502"):
        client.models()


@pytest.mark.parametrize("code", ["bad_image", "not_found", "unauthorized", "paused",
                                  "payload_too_large"])
def test_other_errors_are_not_retried(code):
    script = Script(error(code, {"Retry-After": "1"}), httpx.Response(200, json=ANSWER))
    with mock(script) as client, pytest.raises(CODES[code][1]):
        client.classify(b"x")
    assert len(script.requests) == 1


@pytest.mark.parametrize(("code", "headers"), [
    ("overloaded", {"Retry-After": "1"}),
    ("not_ready", {"Retry-After": "1"}),
    ("loading", {"Retry-After": "1"}),
    ("rate_limited", {"RateLimit-Remaining": "0", "RateLimit-Reset": "1"}),
])
def test_a_refusal_is_retried_after_the_wait_the_server_asked(code, headers):
    script = Script(error(code, headers), httpx.Response(200, json=ANSWER))
    with mock(script) as client:
        assert client.classify(b"x").top.label == "espresso"
    [gap] = script.gaps()
    assert 1.0 <= gap < 1.0 * 1.25 + 0.3  # never sooner; jitter at most 25 %


def test_a_wait_past_the_deadline_raises_at_once():
    script = Script(error("overloaded", {"Retry-After": "30"}), httpx.Response(200, json=ANSWER))
    started = time.monotonic()
    with mock(script, timeout=5) as client, pytest.raises(vg.Overloaded) as raised:
        client.classify(b"x")
    assert time.monotonic() - started < 1
    assert raised.value.retry_after == 30
    assert len(script.requests) == 1


def test_without_retry_after_it_backs_off_and_gives_up_at_max_retries():
    script = Script(error("deadline_exceeded"))
    with mock(script, max_retries=2) as client, pytest.raises(vg.DeadlineExceeded):
        client.classify(b"x")
    assert len(script.requests) == 3
    first, second = script.gaps()
    assert 0.5 <= first < 0.625 + 0.3 and 1.0 <= second < 1.25 + 0.3  # 0.5, 1 s + jitter


def test_concurrent_requests_hold_back_after_a_429():
    """A token bucket of 1 request a second: after a 429 (Retry-After 1) no request of
    the client goes out within that second, so four workers do not flood it."""
    lock = threading.Lock()
    served: list[float] = []
    refused: list[float] = []
    sent: list[float] = []

    def bucket(request: httpx.Request) -> httpx.Response:
        with lock:
            now = time.monotonic()
            sent.append(now)
            if served and now - served[-1] < 1.0:
                refused.append(now)
                return error("rate_limited", {"Retry-After": "1"})
            served.append(now)
            return httpx.Response(200, json=ANSWER)

    with mock(bucket) as client:
        outcomes = list(client.classify_many([b"x"] * 4, concurrency=4))
    assert all(o.ok for o in outcomes) and len(served) == 4 and refused
    for answered in refused:
        assert not [s for s in sent if 0.05 < s - answered < 1.0]


def test_nothing_listening_is_not_running(tmp_path):
    with vg.Client(f"http://127.0.0.1:{free_port()}") as client, \
            pytest.raises(vg.NotRunning, match="is vramguard running"):
        client.models()


def test_classify_many_keeps_going_past_a_missing_file(tmp_path):
    with mock(Script(httpx.Response(200, json=ANSWER))) as client:
        outcomes = sorted(client.classify_many([b"x", tmp_path / "gone.jpg", b"y"]),
                          key=lambda o: o.index)
    assert [o.ok for o in outcomes] == [True, False, True]
    assert isinstance(outcomes[1].error, FileNotFoundError)


def test_a_pil_image_goes_as_png():
    script = Script(httpx.Response(200, json=ANSWER))
    with mock(script) as client:
        client.classify(Image.new("CMYK", (4, 4)), top_k=3, model="efficientnet_lite1")
    _, request = script.requests[0]
    assert request.content.startswith(b"\x89PNG")
    assert request.url.params == httpx.QueryParams(top_k=3, model="efficientnet_lite1")


def test_client_id_names_the_apps_rate_limit_bucket():
    script = Script(httpx.Response(200, json={"models": []}))
    with mock(script, client_id="photo-app.2") as client:
        client.models()
    assert script.requests[0][1].headers["x-client-id"] == "photo-app.2"
    with pytest.raises(ValueError, match="client_id"):
        vg.Client("http://127.0.0.1:1", client_id="photo app")


# --- the admin token goes only to a server that proves it holds it ----------------------

def token_file(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "admin-token"
    path.write_text("s3cret\n")
    path.chmod(mode)
    return path


def test_admin_token_only_after_the_proof(tmp_path):
    seen: list[httpx.Request] = []

    def honest(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/identity":
            nonce = bytes.fromhex(json.loads(request.content)["nonce"])
            body = {"proof": proof_for("s3cret", nonce, 8765)}
            return httpx.Response(200, json=body)
        return httpx.Response(200, json={"reserved_before_bytes": 10,
                                         "reserved_after_bytes": 4, "freed_bytes": 6})

    with mock(honest, token_file=token_file(tmp_path)) as client:
        assert client.empty_cache() == vg.CacheRelease(10, 4, 6)
    assert [r.url.path for r in seen] == ["/v1/identity", "/v1/memory/empty-cache"]
    assert "authorization" not in seen[0].headers
    assert seen[1].headers["authorization"] == "Bearer s3cret"


def proof_for(token: str, nonce: bytes, port: int, address: bytes = bytes([127, 0, 0, 1])
              ) -> str:
    """The protocol written out: HMAC-SHA256(token, nonce ‖ len(address) ‖ address ‖
    port), the address as its packed bytes."""
    message = nonce + bytes([len(address)]) + address + port.to_bytes(2, "big")
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


@pytest.mark.parametrize("answer", [
    httpx.Response(200, json={"proof": "00" * 32}),
    httpx.Response(404, json={"error": {"code": "not_found", "message": "?"}}),
    httpx.Response(200, text="hello"),
])
def test_a_server_that_cannot_prove_gets_no_token(tmp_path, answer):
    script = Script(answer)
    with mock(script, token_file=token_file(tmp_path)) as client, \
            pytest.raises(vg.NotVramguard):
        client.pause()
    assert [r.url.path for _, r in script.requests] == ["/v1/identity"]


def test_the_proof_is_bound_to_the_port():
    nonce = b"n" * 32

    def answer(port: int) -> httpx.Response:
        request = httpx.Request("POST", "http://127.0.0.1:8765/v1/identity")
        return httpx.Response(200, json={"proof": proof_for("t", nonce, port)}, request=request)

    assert proven_origin(answer(8765), "t", nonce, "") == "http://127.0.0.1:8765"
    with pytest.raises(vg.NotVramguard):
        proven_origin(answer(8766), "t", nonce, "")


def test_the_proof_is_bound_to_the_address():
    """An answer made by a vramguard on ::1 (relayed by whoever holds 127.0.0.1) fails on
    127.0.0.1, and the other way round."""
    nonce = b"n" * 32
    v6 = bytes(15) + b"\x01"

    def answer(url: str, address: bytes) -> httpx.Response:
        request = httpx.Request("POST", url + "/v1/identity")
        proof = proof_for("t", nonce, 8765, address)
        return httpx.Response(200, json={"proof": proof}, request=request)

    with pytest.raises(vg.NotVramguard):
        proven_origin(answer("http://127.0.0.1:8765", v6), "t", nonce, "")
    with pytest.raises(vg.NotVramguard):
        proven_origin(answer("http://[::1]:8765", bytes([127, 0, 0, 1])), "t", nonce, "")
    assert proven_origin(answer("http://[::1]:8765", v6), "t", nonce, "") == \
        "http://[::1]:8765"


def test_the_token_never_follows_a_server_that_moved(tmp_path):
    """The proof came from port 8765; when 8765 then stops answering and an instance file
    names another port, the token is not sent there."""
    seen: list[httpx.Request] = []
    with contextlib.ExitStack() as later:

        def vanishing(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            if request.url.port != 8765:
                return httpx.Response(200, json={"paused": True})
            if request.url.path == "/v1/identity":
                later.enter_context(instance(tmp_path / "run", 9500, held=True))
                nonce = bytes.fromhex(json.loads(request.content)["nonce"])
                return httpx.Response(200, json={"proof": proof_for("s3cret", nonce, 8765)})
            raise httpx.ConnectError("connection refused", request=request)

        with vg.Client(transport=httpx.MockTransport(vanishing),
                       token_file=token_file(tmp_path)) as client, \
                pytest.raises(vg.NotRunning):
            assert client.location.source == "default"
            client.pause()
    assert [(r.url.port, r.url.path) for r in seen] == \
        [(8765, "/v1/identity"), (8765, "/v1/admin/pause")]


def test_a_token_file_others_can_read_is_refused(tmp_path):
    script = Script(httpx.Response(200, json={}))
    with mock(script, token_file=token_file(tmp_path, 0o644)) as client, \
            pytest.raises(vg.Unauthorized, match="chmod 600"):
        client.resume()
    assert script.requests == []


def test_a_model_being_loaded_holds_back_only_its_own_request():
    """``loading`` is about one model: another request of the client goes out at once."""
    script = Script(error("loading", {"Retry-After": "2"}), httpx.Response(200, json=ANSWER),
                    httpx.Response(200, json=ANSWER))
    with mock(script) as client:
        worker = threading.Thread(target=client.classify, args=(b"x",),
                                  kwargs={"model": "efficientnet_lite1"})
        worker.start()
        while not script.requests:
            time.sleep(0.01)
        assert client.classify(b"y").top.label == "espresso"
        worker.join(10)
    # The other went out during the 2 s wait, before the retry.
    assert [r.content for _, r in script.requests] == [b"x", b"y", b"x"]


def test_a_cached_answer_has_no_batch_size():
    cached = {**ANSWER, "batch_size": None, "cached": True}
    with mock(Script(httpx.Response(200, json=cached))) as client:
        answer = client.classify(b"x")
    assert answer.cached and answer.batch_size is None


# --- own models: multilabel answers, the threshold, what models() says of each -----------

TAGS = [{"label": "dog", "index": 3, "score": 0.91}, {"label": "grass", "index": 7, "score": 0.62}]
MULTILABEL = {**ANSWER, "model": "my-tagger", "predictions": TAGS, "labels": TAGS,
              "threshold": 0.4}


def test_a_multilabel_answer_has_every_label_above_its_threshold():
    script = Script(httpx.Response(200, json=MULTILABEL))
    with mock(script) as client:
        answer = client.classify(b"x", model="my-tagger", threshold=0.4)
    assert answer.labels == (vg.Prediction("dog", 3, 0.91), vg.Prediction("grass", 7, 0.62))
    assert answer.predictions == answer.labels and answer.threshold == 0.4
    assert answer.top.label == "dog"
    assert script.requests[0][1].url.params == \
        httpx.QueryParams(top_k=5, model="my-tagger", threshold=0.4)


def test_a_single_label_answer_and_an_older_servers_have_no_labels():
    single = {**ANSWER, "labels": None, "threshold": None}
    for body in (ANSWER, single):  # ANSWER: an older server's, without either
        script = Script(httpx.Response(200, json=body))
        with mock(script) as client:
            answer = client.classify(b"x")
        assert (answer.labels, answer.threshold, answer.top.label) == (None, None, "espresso")
        assert "threshold" not in script.requests[0][1].url.params  # only when given


def test_a_multilabel_answer_with_no_label_above_the_threshold():
    empty = {**MULTILABEL, "predictions": [], "labels": [], "threshold": 0.99}
    with mock(Script(httpx.Response(200, json=empty))) as client:
        answer = client.classify(b"x", threshold=0.99)
    assert answer.labels == () and answer.predictions == ()
    with pytest.raises(IndexError, match=r"threshold 0\.99"):
        _ = answer.top


def test_classify_many_and_the_async_client_pass_the_threshold():
    asked: list[str | None] = []

    def tagger(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params.get("threshold"))
        return httpx.Response(200, json=MULTILABEL)

    with mock(tagger) as client:
        outcomes = list(client.classify_many([b"x", b"y"], model="my-tagger", threshold=0.3))
    assert all(o.ok and o.result and o.result.labels for o in outcomes)

    async def run() -> list[vg.Outcome[vg.Classification]]:
        async with vg.AsyncClient("http://127.0.0.1:8765",
                                  transport=httpx.MockTransport(tagger)) as client:
            single = await client.classify(b"z", threshold=0.25)
            assert single.threshold == 0.4  # what the (mock) server said
            return [o async for o in client.classify_many([b"w"], threshold=0.2)]

    assert all(o.ok for o in asyncio.run(run()))
    assert asked == ["0.3", "0.3", "0.25", "0.2"]


MODEL = {"name": "efficientnet_lite0", "state": "loaded", "family": "efficientnet_lite",
         "input_size": 224, "installed": True, "device": "cuda:0", "batch_size": 32}


def test_models_say_their_task_format_and_labels():
    own = {**MODEL, "name": "my-embedder", "task": "embed", "format": "onnx", "labels": 0}
    with mock(Script(httpx.Response(200, json={"models": [MODEL, own]}))) as client:
        older, embedder = client.models()
    assert (older.task, older.format, older.labels) == ("classify", "", 1000)  # defaults
    assert (embedder.task, embedder.format, embedder.labels) == ("embed", "onnx", 0)
    assert embedder.loaded and embedder.name == "my-embedder"


def test_classify_with_an_embed_only_model_is_a_bad_request():
    refused = error("bad_request")
    with mock(Script(refused)) as client, pytest.raises(vg.BadRequest):
        client.classify(b"x", model="my-embedder")


# --- images go only to a found appliance that proved it is this user's (issue 26) -------

def proving(token: str, answer: httpx.Response, port: int = 8765) -> Script:
    """A vramguard on 127.0.0.1:``port`` holding ``token``: the right proof, then ``answer``."""

    class Proving(Script):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/identity":
                self.requests.append((time.monotonic(), request))
                nonce = bytes.fromhex(json.loads(request.content)["nonce"])
                return httpx.Response(200, json={"proof": proof_for(token, nonce, port)})
            return super().__call__(request)

    return Proving(answer)


def found_client(script: Script, token_file: Path) -> vg.Client:
    return vg.Client(transport=httpx.MockTransport(script), token_file=token_file)


def test_a_found_server_proves_itself_once_before_the_first_image(tmp_path):
    script = proving("s3cret", httpx.Response(200, json=ANSWER))
    with found_client(script, token_file(tmp_path)) as client:
        assert client.location.source == "default"
        client.classify(b"x")
        client.classify(b"z")
        list(client.classify_many([b"a", b"b"], concurrency=2))
    paths = [r.url.path for _, r in script.requests]
    assert paths == ["/v1/identity"] + ["/v1/classify"] * 4, paths
    assert all("authorization" not in r.headers for _, r in script.requests)


def test_a_program_holding_the_port_gets_no_image(tmp_path):
    squatter = proving("another user's token", httpx.Response(200, json=ANSWER))
    with found_client(squatter, token_file(tmp_path)) as client, \
            pytest.raises(vg.NotVramguard, match="no image was sent"):
        client.classify(b"x")
    assert [r.url.path for _, r in squatter.requests] == ["/v1/identity"]


def test_without_the_token_file_no_image_is_sent_and_the_message_says_how(tmp_path):
    script = proving("s3cret", httpx.Response(200, json=ANSWER))
    with found_client(script, tmp_path / "none") as client, \
            pytest.raises(vg.NotVramguard, match=r"admin token file .* give its URL yourself"):
        client.classify(b"x")
    assert [r.url.path for _, r in script.requests] == ["/v1/identity"]


def test_a_named_url_is_taken_as_given(tmp_path):
    script = Script(httpx.Response(200, json=ANSWER))
    with mock(script, token_file=tmp_path / "none") as client:
        client.classify(b"x")
    assert [r.url.path for _, r in script.requests] == ["/v1/classify"]


def test_the_async_client_proves_a_found_server_too(tmp_path):
    squatter = proving("another user's token", httpx.Response(200, json=ANSWER))
    honest = proving("s3cret", httpx.Response(200, json=ANSWER))

    async def run(script: Script) -> None:
        async with vg.AsyncClient(transport=httpx.MockTransport(script),
                                  token_file=token_file(tmp_path)) as client:
            await client.classify(b"x")
            await client.classify(b"y")

    asyncio.run(run(honest))
    assert [r.url.path for _, r in honest.requests] == \
        ["/v1/identity", "/v1/classify", "/v1/classify"]
    with pytest.raises(vg.NotVramguard):
        asyncio.run(run(squatter))
    assert [r.url.path for _, r in squatter.requests] == ["/v1/identity"]
