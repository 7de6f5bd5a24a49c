"""The blocking client."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx

from vramguard_client import _types as types
from vramguard_client._discovery import ServerLocation, find_server
from vramguard_client._errors import NotRunning, VramguardError
from vramguard_client._protocol import (
    JSON,
    NO_IMAGE_SENT,
    OCTETS,
    Call,
    ImageInput,
    Pace,
    Progress,
    error_from,
    headers_for,
    image_bytes,
    image_params,
    image_token,
    json_body,
    model_path,
    new_challenge,
    proven_origin,
    read_token,
    transport_error,
)


class Client:
    """A blocking client of the vramguard appliance on this computer.

    Without ``url`` it finds the running appliance itself (``find_server``). Every call
    retries what the server says is worth retrying (429, and 503 overloaded,
    deadline_exceeded, not_ready, insufficient_memory), waiting at least its
    ``Retry-After``, within ``timeout`` seconds for the whole call. ``client_id`` (letters,
    digits, ``._-``) gives this app a rate-limit bucket of its own."""

    def __init__(self, url: str | None = None, *, timeout: float = 60.0,
                 token_file: str | os.PathLike[str] | None = None,
                 client_id: str | None = None, max_retries: int = 10,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._explicit_url = url
        self._token_file = token_file
        self.location: ServerLocation = find_server(url, token_file)
        self.timeout = timeout
        self.max_retries = max_retries
        self._pace = Pace()
        self._proven: str | None = None  # the found appliance's URL, once it proved itself
        self._proving = threading.Lock()
        self._http = httpx.Client(base_url=self.location.url, headers=headers_for(client_id),
                                  transport=transport, timeout=timeout,
                                  trust_env=not self.location.local)

    @property
    def url(self) -> str:
        return self.location.url

    def _call(self, timeout: float | None, paced: bool = False) -> Call:
        return Call(self.timeout if timeout is None else timeout, self.max_retries,
                    self._pace if paced else None)

    def _moved(self, call: Call) -> bool:
        """Once per call, when nothing answers: whether a found (not given) appliance
        now runs elsewhere (restarted on another port, say); then it is used."""
        if self._explicit_url or not call.may_follow:
            return False
        call.may_follow = False
        found = find_server(None, self._token_file)
        if found.url == self.location.url:
            return False
        self.location = found
        self._http.base_url = httpx.URL(found.url)
        return True

    def _send(self, call: Call, method: str, path: str, *, content: bytes | None = None,
              params: Mapping[str, Any] | None = None,
              headers: Mapping[str, str] | None = None,
              images: bool = False) -> httpx.Response:
        """One call with its retries: the successful answer, or the error raised.
        ``images``: they go only to a found appliance that proved it is this user's
        (``_found_origin``)."""
        while True:
            while wait := call.before_try():  # a hold may be extended meanwhile
                time.sleep(wait)
            try:
                target = self._found_origin(call) + path if images else path
                response = self._http.request(method, target, content=content, params=params,
                                              headers=headers, timeout=call.try_timeout())
            except httpx.TransportError as exc:
                error = transport_error(exc, self.url)
                if isinstance(error, NotRunning) and self._moved(call):
                    continue
            else:
                if response.is_success:
                    return response
                error = error_from(response)
            time.sleep(call.after_failure(error))

    def _prove(self, call: Call, token_of: Callable[[], str], withheld: str) -> str:
        """The origin of the server this client found, once it has proved it knows the
        token (``token_of``, read once it has answered) at the address and port this
        client reached; NotVramguard (nothing sent but the challenge) when it cannot."""
        nonce, challenge = new_challenge()
        try:
            answer: httpx.Response | None = self._send(
                call, "POST", "/v1/identity", content=challenge, headers=JSON)
        except VramguardError as exc:
            if exc.status is None or exc.status in (429, 503):
                raise
            answer = None  # an answer, but not vramguard's to a challenge
        return proven_origin(answer, token_of(), nonce, self.url, withheld)

    def _found_origin(self, call: Call) -> str:
        """Where images go: "" (the given URL) when the app named the server, else the
        found appliance's origin once it has proved it is this user's vramguard (once per
        place it is found at). Another program holding the port gets no image."""
        if self._explicit_url:
            return ""
        with self._proving:
            if self._proven != self.location.url:
                location = self.location
                self._proven = self._prove(
                    call, lambda: image_token(location.token_file, location.url),
                    NO_IMAGE_SENT)
            return self._proven

    def verify(self, *, timeout: float | None = None) -> str:
        """The appliance's URL, once a found one has proved it is this user's vramguard
        (it knows the admin token at the address and port reached), as ``classify`` and
        ``embed`` make it do before their first image; NotVramguard when it cannot. A
        ``url`` given to the client is returned as it is, unchecked."""
        origin = self._found_origin(self._call(timeout))
        return origin or self.url

    def _admin(self, path: str, timeout: float | None) -> dict[str, Any]:
        """An admin call: the token goes only to a server that proved it knows it."""
        token = read_token(self.location.token_file)
        call = self._call(timeout)
        origin = self._prove(call, lambda: token, "the admin token was not sent")
        # The token goes only where the proof came from: never to a server found after it
        # (this call does not follow a move), and to that origin even if another call of
        # this client has moved it meanwhile.
        call.may_follow = False
        return json_body(self._send(call, "POST", origin + path,
                                    headers={"Authorization": f"Bearer {token}"}))

    def classify(self, image: ImageInput, top_k: int = 5, model: str | None = None, *,
                 keep_alive: float | None = None, threshold: float | None = None,
                 timeout: float | None = None) -> types.Classification:
        """The image's ``top_k`` most likely classes (``model``: any name ``models()``
        lists; the appliance's default when None). A multilabel model answers every label
        scored above ``threshold`` instead (between 0 and 1; None: the model's own).
        ``keep_alive``: seconds the model stays loaded after each use, at least; it can
        only lengthen the model's stay, up to the server's ``max_keep_alive_s``. A shorter
        one, 0 or -1 needs the admin token, which this call never sends, so the server
        ignores it and leaves the stay as it was; to free the memory, ``unload_model``."""
        answer = self._send(self._call(timeout, paced=True), "POST", "/v1/classify",
                            content=image_bytes(image), headers=OCTETS,
                            params=image_params(top_k, model, keep_alive, threshold), images=True)
        return types.classification(json_body(answer))

    def embed(self, image: ImageInput, model: str | None = None, *,
              keep_alive: float | None = None, timeout: float | None = None) -> types.Embedding:
        """The image's L2-normalised features (for similar images and duplicates);
        ``keep_alive`` as for ``classify``."""
        answer = self._send(self._call(timeout, paced=True), "POST", "/v1/embed",
                            content=image_bytes(image), headers=OCTETS,
                            params=image_params(None, model, keep_alive), images=True)
        return types.embedding(json_body(answer))

    def classify_many(self, images: Iterable[ImageInput], top_k: int = 5,
                      model: str | None = None, *, concurrency: int = 4,
                      on_progress: Progress | None = None, threshold: float | None = None,
                      ) -> Iterator[types.Outcome[types.Classification]]:
        """Classify ``images`` with up to ``concurrency`` requests at once, yielding each
        ``Outcome`` as it finishes (its ``index`` says which input it was). One image's
        failure is that outcome's ``error``; the others go on."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        total = len(images) if isinstance(images, Sized) else None

        def one(index: int, image: ImageInput) -> types.Outcome[types.Classification]:
            try:
                result = self.classify(image, top_k, model, threshold=threshold)
                return types.Outcome(index, image, result=result)
            except (VramguardError, OSError) as exc:
                return types.Outcome(index, image, error=exc)

        inputs = enumerate(images)
        done = 0
        with ThreadPoolExecutor(concurrency, thread_name_prefix="vramguard-client") as pool:
            pending: set[Future[types.Outcome[types.Classification]]] = set()
            while True:
                for index, image in itertools.islice(inputs, concurrency - len(pending)):
                    pending.add(pool.submit(one, index, image))
                if not pending:
                    return
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    done += 1
                    if on_progress is not None:
                        on_progress(done, total)
                    yield future.result()

    def models(self, *, timeout: float | None = None) -> list[types.ModelInfo]:
        """Every model this appliance can serve, loaded or not."""
        answer = self._send(self._call(timeout), "GET", "/v1/models")
        return types.model_list(json_body(answer))

    def memory(self, *, timeout: float | None = None) -> types.MemoryInfo:
        """Device memory, the budget and the guard's state."""
        answer = self._send(self._call(timeout), "GET", "/v1/memory")
        return types.memory_info(json_body(answer))

    def empty_cache(self, *, timeout: float | None = None) -> types.CacheRelease:
        """Admin: give cached GPU memory back to other programs."""
        return types.cache_release(self._admin("/v1/memory/empty-cache", timeout))

    def load_model(self, name: str, *, timeout: float | None = None) -> types.ModelInfo:
        """Admin: load ``name`` now and keep it until unloaded (a first load measures the
        model, which can take a minute: give a longer ``timeout`` then)."""
        return types.model_info(self._admin(model_path(name, "load"), timeout))

    def unload_model(self, name: str, *, timeout: float | None = None) -> None:
        """Admin: unload ``name`` (Conflict while it has images in progress)."""
        self._admin(model_path(name, "unload"), timeout)

    def pause(self, *, timeout: float | None = None) -> None:
        """Admin: stop taking images (they get ``Paused``) until ``resume``."""
        self._admin("/v1/admin/pause", timeout)

    def resume(self, *, timeout: float | None = None) -> None:
        """Admin: take images again."""
        self._admin("/v1/admin/resume", timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
