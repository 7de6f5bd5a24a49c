"""``POST /v2/models/{name}/infer``: the Open Inference Protocol's inference, every image
through ``image_flow`` (see ``app/api/oip.py``); the bodies are ``oip_codec``'s.

A request is checked whole before it loads anything: for a model not loaded yet the body
is read and parsed against what the catalogue says of the model (``facts``), so that a
bodiless or malformed request answers 400 without loading it. Each image costs one
classify token, as on ``/v1/classify`` and the stream (``take_tokens``): the request's
own pays for the first, the others are taken once the body says how many there are.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import Response

from app.api.image_flow import (
    Ask,
    Image,
    Served,
    admit_after,
    after_body,
    find_model,
    in_time_left_by_load,
    is_loaded,
    serve_in_place,
    unless_disconnected,
)
from app.api.keep_alive import caller_of
from app.api.oip_codec import (
    CHANNELS,
    EMBEDDING,
    HEADER_LENGTH,
    PIXELS,
    PROBABILITIES,
    InferRequest,
    Tensor,
    encode_response,
    parse_request,
)
from app.engine.engine import InferenceEngine
from app.engine.lanes import Reservation
from app.engine.predictor import CLASSIFY, EMBED
from app.engine.runtime import unknown_model
from app.engine.view import EngineView
from app.errors import ApiError, BadRequest, NotReady, UnsupportedMediaType
from app.gates.body_limit import body_done
from app.gates.rate_limit import take_tokens
from app.http.state import AppState, state_of
from app.models import LoadedModel

VERSION = "1"  # each model has one version
T = TypeVar("T")


@dataclass(frozen=True)
class Facts:
    """What a request is checked against: the model's input and what it answers."""

    crop: int
    classes: int
    features: int  # 0: none; -1: not known until loaded
    task: str = "classify"
    channels: int = CHANNELS

    @classmethod
    def of(cls, model: LoadedModel) -> Facts:
        return cls(model.preprocessing.crop, model.num_classes, model.feature_dim,
                   model.task, model.preprocessing.channels)


def facts(engine: InferenceEngine, name: str) -> Facts:
    """What is known of a model without loading it: everything once loaded, else what the
    catalogue says (its labels; the feature length only the loaded model gives)."""
    if not engine.knows(name):
        raise unknown_model(name)
    view = engine.view()
    loaded = view.models.get(name)
    if loaded is None:
        entry = engine.sources.entry(name)
        if entry is not None:
            return Facts(entry.input_size, entry.labels, -1, entry.task, entry.channels)
        loaded = view.loaded(name)  # raises: a --model(s) one, not loaded
    return Facts(loaded.crop, loaded.classes, loaded.features, loaded.task, loaded.channels)


def require_serving(view: EngineView) -> None:
    """NotReady while starting or after a failure, Paused while paused."""
    if not view.ready:
        raise NotReady(view.not_ready_message, retry_after=2)
    view.require_unpaused()


def _plan(parsed: InferRequest, known: Facts, name: str) -> Ask:
    """What each image of the request is asked for, from the outputs it names (a feature
    length not known yet passes: it is checked again once the model is loaded)."""
    names = {want.name for want in parsed.outputs}
    if known.task == EMBED and PROBABILITIES in names:
        raise BadRequest(f"The model {name} gives image features only: ask for the "
                         f"{EMBEDDING} output.")
    if EMBEDDING in names and not known.features:
        raise BadRequest(f"The model {name} has no {EMBEDDING} output (no final linear "
                         "layer to take features from); use an EfficientNet-Lite model.")
    classes = known.classes
    top_k = max((min(want.classes, classes) if want.classes else classes
                 for want in parsed.outputs if want.name == PROBABILITIES), default=1)
    return Ask(EMBED if EMBEDDING in names else CLASSIFY, top_k,
               use_cache=not {EMBEDDING, PROBABILITIES} <= names)


async def _read_body(request: Request) -> bytes:
    """The body, uncompressed only (a small gzip body can inflate past every limit), read
    from the stream rather than ``request.body()``, which would keep it to the end."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"Content-Encoding '{encoding[:20]}' is not accepted: send "
                                   "the request uncompressed.")
    return b"".join([chunk async for chunk in request.stream()])


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


async def _parsed(request: Request, state: AppState, name: str,
                  known: Facts) -> tuple[InferRequest, float]:
    """The body, read and parsed on the CPU pool and checked against ``known``; then its
    further images' tokens, paid; and the request's deadline, counted from the body's
    arrival (``image_flow.after_body``)."""
    body = await _read_body(request)
    deadline = after_body(state)
    parsed = await state.pool.run_before(deadline, parse_request, body,
                                         request.headers.get(HEADER_LENGTH), known.crop,
                                         known.channels,
                                         EMBEDDING if known.task == EMBED else PROBABILITIES)
    del body
    _plan(parsed, known, name)
    await take_tokens(request.scope, parsed.count - 1, deadline)
    return parsed, deadline


def _check_pixels(parsed: InferRequest, model: LoadedModel) -> None:
    """Pixels checked against the catalogue's shape fit the model loaded since."""
    shape = [model.preprocessing.channels, model.preprocessing.crop, model.preprocessing.crop]
    if parsed.pixels is not None and list(parsed.pixels.shape[1:]) != shape:
        raise BadRequest(f"{PIXELS}'s shape must be [N, {', '.join(map(str, shape))}] for "
                         f"this model, not {list(parsed.pixels.shape)}.")


async def serve_inference(request: Request, name: str) -> Response:
    """For a loaded model a place for the first image before the body is read (or 503);
    for one not loaded the body read and checked first, then the load. One more place
    for each further image once the body says how many, every image through
    ``image_flow``."""
    state = state_of(request)
    engine = state.engine
    started = time.perf_counter()
    deadline = time.monotonic() + state.settings.request_timeout_s
    waits = not is_loaded(state, name)
    caller = caller_of(request)
    with ExitStack() as places:
        if waits:
            require_serving(engine.view())
            parsed, deadline = await _parsed(request, state, name, facts(engine, name))
            model = await find_model(state, name, caller=caller)
            _check_pixels(parsed, model)
            first = places.enter_context(admit_after(state, model, deadline, waits))
        else:
            model = await find_model(state, name, caller=caller)
            first = places.enter_context(admit_after(state, model, deadline, waits))
            parsed, deadline = await _parsed(request, state, name, Facts.of(model))
        places.enter_context(in_time_left_by_load(model.name, waits))
        plan = _plan(parsed, Facts.of(model), model.name)
        spots = [first, *(places.enter_context(engine.admit(_left(deadline), model.name))
                          for _ in range(parsed.count - 1))]
        work = asyncio.ensure_future(_serve_all(request, model, parsed, spots, deadline, plan,
                                                started))
        served: list[Served] = await unless_disconnected(request, work)
    payload, header_length = await state.pool.run(_encode, parsed, model, served)
    if header_length is None:
        return Response(payload, media_type="application/json")
    return Response(payload, media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(header_length)})


async def _serve_all(request: Request, model: LoadedModel, parsed: InferRequest,
                     spots: list[Reservation], deadline: float, plan: Ask,
                     started: float) -> list[Served]:
    """Every image at once, each in its place; the first failure cancels the others (their
    places are withdrawn) and answers for the request. The upload's bytes are given back
    to the body limits once every file is decoded (pixels: at once, they are copies)."""
    undecoded = len(parsed.images)
    if not undecoded:
        body_done(request.scope)

    def decoded() -> None:
        nonlocal undecoded
        undecoded -= 1
        if not undecoded:
            body_done(request.scope)

    async def one(index: int, place: Reservation) -> Served:
        try:
            return await serve_in_place(request, model, place, _take(parsed, index), plan,
                                        deadline, started, watch=False, decoded=decoded)
        except ApiError as exc:
            if parsed.count > 1:
                exc.message = f"{parsed.input_name}[{index}]: {exc.message}"
            raise

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, place)) for i, place in enumerate(spots)]
    except BaseExceptionGroup as failed:
        raise _first(failed) from None
    return [task.result() for task in tasks]


def _take(parsed: InferRequest, index: int) -> Image:
    """Image ``index``'s pixels, or its bytes taken out of the request (so that they are
    freed once decoded)."""
    if parsed.pixels is not None:
        return torch.from_numpy(parsed.pixels[index])
    data, parsed.images[index] = parsed.images[index], b""
    return data


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first


def _encode(parsed: InferRequest, model: LoadedModel,
            served: list[Served]) -> tuple[bytes, int | None]:
    """The outputs asked for, in their order, encoded (on the CPU pool: an answer of 64
    images' probabilities is 64,000 numbers)."""
    count, classes = len(served), model.num_classes
    tensors = []
    for want in parsed.outputs:
        if want.name == EMBEDDING:
            values = np.stack([_given(s.embedding) for s in served]).astype(np.float32)
            tensors.append(Tensor(EMBEDDING, list(values.shape), values, want.binary))
        elif want.classes:
            k = min(want.classes, classes)
            strings = [f"{score:f}:{index}:{model.labels[index]}" for s in served
                       for index, score in zip(_given(s.ranked).indices[:k],
                                               _given(s.ranked).scores[:k], strict=True)]
            tensors.append(Tensor(PROBABILITIES, [count, k], strings, want.binary))
        else:
            probabilities = np.zeros((count, classes), dtype=np.float32)
            for row, s in enumerate(served):
                probabilities[row, _given(s.ranked).indices] = _given(s.ranked).scores
            tensors.append(Tensor(PROBABILITIES, [count, classes], probabilities,
                                  want.binary))
    return encode_response(model.name, VERSION, parsed.id, tensors)


def _given(value: T | None) -> T:
    """What the plan asked the forward pass (or the cache) for is there."""
    assert value is not None
    return value

