"""The asyncio client: the same calls as ``Client``, awaited."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sized
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


async def _upload(image: ImageInput) -> bytes:
    """The bytes to send, read or encoded off the event loop unless already bytes."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    return await asyncio.to_thread(image_bytes, image)


async def _numbered(images: Iterable[ImageInput] | AsyncIterable[ImageInput],
                    ) -> AsyncIterator[tuple[int, ImageInput]]:
    if isinstance(images, AsyncIterable):
        index = 0
        async for image in images:
            yield index, image
            index += 1
    else:
        for pair in enumerate(images):
            yield pair


class AsyncClient:
    """The asyncio twin of ``Client``: same discovery, retries and errors."""

    def __init__(self, url: str | None = None, *, timeout: float = 60.0,
                 token_file: str | os.PathLike[str] | None = None,
                 client_id: str | None = None, max_retries: int = 10,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._explicit_url = url
        self._token_file = token_file
        self.location: ServerLocation = find_server(url, token_file)
        self.timeout = timeout
        self.max_retries = max_retries
        self._pace = Pace()
        self._proven: str | None = None  # the found appliance's URL, once it proved itself
        self._proving = asyncio.Lock()
        self._http = httpx.AsyncClient(base_url=self.location.url,
                                       headers=headers_for(client_id), transport=transport,
                                       timeout=timeout,
                                       trust_env=not self.location.local)

    @property
    def url(self) -> str:
        return self.location.url

    def _call(self, timeout: float | None, paced: bool = False) -> Call:
        return Call(self.timeout if timeout is None else timeout, self.max_retries,
                    self._pace if paced else None)

    def _moved(self, call: Call) -> bool:
        """As ``Client._moved``: a found appliance that now runs elsewhere is followed."""
        if self._explicit_url or not call.may_follow:
            return False
        call.may_follow = False
        found = find_server(None, self._token_file)
        if found.url == self.location.url:
            return False
        self.location = found
        self._http.base_url = httpx.URL(found.url)
        return True

    async def _send(self, call: Call, method: str, path: str, *,
                    content: bytes | None = None, params: Mapping[str, Any] | None = None,
                    headers: Mapping[str, str] | None = None,
                    images: bool = False) -> httpx.Response:
        """One call with its retries: the successful answer, or the error raised.
        ``images``: they go only to a found appliance that proved it is this user's
        (``_found_origin``)."""
        while True:
            while wait := call.before_try():  # a hold may be extended meanwhile
                await asyncio.sleep(wait)
            try:
                target = await self._found_origin(call) + path if images else path
                response = await self._http.request(method, target, content=content,
                                                    params=params, headers=headers,
                                                    timeout=call.try_timeout())
            except httpx.TransportError as exc:
                error = transport_error(exc, self.url)
                if isinstance(error, NotRunning) and self._moved(call):
                    continue
            else:
                if response.is_success:
                    return response
                error = error_from(response)
            await asyncio.sleep(call.after_failure(error))

    async def _prove(self, call: Call, token_of: Callable[[], str], withheld: str) -> str:
        """The origin of the server this client found, once it has proved it knows the
        token (``token_of``, read once it has answered) at the address and port this
        client reached; NotVramguard (nothing sent but the challenge) when it cannot."""
        nonce, challenge = new_challenge()
        try:
            answer: httpx.Response | None = await self._send(
                call, "POST", "/v1/identity", content=challenge, headers=JSON)
        except VramguardError as exc:
            if exc.status is None or exc.status in (429, 503):
                raise
            answer = None  # an answer, but not vramguard's to a challenge
        return proven_origin(answer, token_of(), nonce, self.url, withheld)

    async def _found_origin(self, call: Call) -> str:
        """Where images go: "" (the given URL) when the app named the server, else the
        found appliance's origin once it has proved it is this user's vramguard (once per
        place it is found at). Another program holding the port gets no image."""
        if self._explicit_url:
            return ""
        async with self._proving:
            if self._proven != self.location.url:
                location = self.location
                self._proven = await self._prove(
                    call, lambda: image_token(location.token_file, location.url),
                    NO_IMAGE_SENT)
            return self._proven

    async def verify(self, *, timeout: float | None = None) -> str:
        """The appliance's URL, once a found one has proved it is this user's vramguard
        (it knows the admin token at the address and port reached), as ``classify`` and
        ``embed`` make it do before their first image; NotVramguard when it cannot. A
        ``url`` given to the client is returned as it is, unchecked."""
        origin = await self._found_origin(self._call(timeout))
        return origin or self.url

    async def _admin(self, path: str, timeout: float | None) -> dict[str, Any]:
        """An admin call: the token goes only to a server that proved it knows it."""
        token = read_token(self.location.token_file)
        call = self._call(timeout)
        origin = await self._prove(call, lambda: token, "the admin token was not sent")
        # The token goes only where the proof came from: never to a server found after it
        # (this call does not follow a move), and to that origin even if another call of
        # this client has moved it meanwhile.
        call.may_follow = False
        return json_body(await self._send(call, "POST", origin + path,
                                    headers={"Authorization": f"Bearer {token}"}))

    async def classify(self, image: ImageInput, top_k: int = 5, model: str | None = None,
                       *, keep_alive: float | None = None, threshold: float | None = None,
                       timeout: float | None = None) -> types.Classification:
        """The image's ``top_k`` most likely classes (as ``Client.classify``; a multilabel
        model: every label above ``threshold``; ``keep_alive`` only lengthens a stay)."""
        answer = await self._send(self._call(timeout, paced=True), "POST", "/v1/classify",
                                  content=await _upload(image), headers=OCTETS,
                                  params=image_params(top_k, model, keep_alive, threshold),
                                  images=True)
        return types.classification(json_body(answer))

    async def embed(self, image: ImageInput, model: str | None = None, *,
                    keep_alive: float | None = None,
                    timeout: float | None = None) -> types.Embedding:
        """The image's L2-normalised features (``keep_alive`` as for ``classify``)."""
        answer = await self._send(self._call(timeout, paced=True), "POST", "/v1/embed",
                                  content=await _upload(image), headers=OCTETS,
                                  params=image_params(None, model, keep_alive), images=True)
        return types.embedding(json_body(answer))

    async def _outcome(self, index: int, image: ImageInput, top_k: int, model: str | None,
                       threshold: float | None) -> types.Outcome[types.Classification]:
        try:
            result = await self.classify(image, top_k, model, threshold=threshold)
            return types.Outcome(index, image, result=result)
        except (VramguardError, OSError) as exc:
            return types.Outcome(index, image, error=exc)

    async def classify_many(self, images: Iterable[ImageInput] | AsyncIterable[ImageInput],
                            top_k: int = 5, model: str | None = None, *,
                            concurrency: int = 4, on_progress: Progress | None = None,
                            threshold: float | None = None,
                            ) -> AsyncIterator[types.Outcome[types.Classification]]:
        """As ``Client.classify_many``, an async iterator; ``images`` may be async too."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        total = len(images) if isinstance(images, Sized) else None
        inputs = _numbered(images)
        pending: set[asyncio.Task[types.Outcome[types.Classification]]] = set()
        more, done = True, 0
        try:
            while True:
                while more and len(pending) < concurrency:
                    try:
                        index, image = await anext(inputs)
                    except StopAsyncIteration:
                        more = False
                    else:
                        pending.add(asyncio.create_task(
                            self._outcome(index, image, top_k, model, threshold)))
                if not pending:
                    return
                finished, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    done += 1
                    if on_progress is not None:
                        on_progress(done, total)
                    yield task.result()
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def models(self, *, timeout: float | None = None) -> list[types.ModelInfo]:
        """Every model this appliance can serve, loaded or not."""
        answer = await self._send(self._call(timeout), "GET", "/v1/models")
        return types.model_list(json_body(answer))

    async def memory(self, *, timeout: float | None = None) -> types.MemoryInfo:
        """Device memory, the budget and the guard's state."""
        answer = await self._send(self._call(timeout), "GET", "/v1/memory")
        return types.memory_info(json_body(answer))

    async def empty_cache(self, *, timeout: float | None = None) -> types.CacheRelease:
        """Admin: give cached GPU memory back to other programs."""
        return types.cache_release(await self._admin("/v1/memory/empty-cache", timeout))

    async def load_model(self, name: str, *, timeout: float | None = None) -> types.ModelInfo:
        """Admin: load ``name`` now and keep it until unloaded."""
        return types.model_info(await self._admin(model_path(name, "load"), timeout))

    async def unload_model(self, name: str, *, timeout: float | None = None) -> None:
        """Admin: unload ``name`` (Conflict while it has images in progress)."""
        await self._admin(model_path(name, "unload"), timeout)

    async def pause(self, *, timeout: float | None = None) -> None:
        """Admin: stop taking images until ``resume``."""
        await self._admin("/v1/admin/pause", timeout)

    async def resume(self, *, timeout: float | None = None) -> None:
        """Admin: take images again."""
        await self._admin("/v1/admin/resume", timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
