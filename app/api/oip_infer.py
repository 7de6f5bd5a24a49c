"""``POST /v2/models/{name}/infer``: the Open Inference Protocol's inference, every image
through ``image_flow`` (see ``app/api/oip.py``); the bodies are ``oip_codec``'s."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
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
    find_model,
    in_time_left_by_load,
    is_loaded,
    serve_in_place,
    unless_disconnected,
)
from app.api.oip_codec import (
    EMBEDDING,
    HEADER_LENGTH,
    PROBABILITIES,
    InferRequest,
    Tensor,
    encode_response,
    parse_request,
)
from app.engine.lanes import Reservation
from app.engine.predictor import CLASSIFY, EMBED
from app.errors import ApiError, BadRequest, UnsupportedMediaType
from app.gates.body_limit import body_done
from app.http.state import state_of
from app.models import LoadedModel

VERSION = "1"  # each model has one version
T = TypeVar("T")


def _plan(parsed: InferRequest, model: LoadedModel) -> Ask:
    """What each image of the request is asked for, from the outputs it names."""
    names = {want.name for want in parsed.outputs}
    if model.task == EMBED and PROBABILITIES in names:
        raise BadRequest(f"The model {model.name} gives image features only: ask for the "
                         f"{EMBEDDING} output.")
    if EMBEDDING in names and not model.feature_dim:
        raise BadRequest(f"The model {model.name} has no {EMBEDDING} output (no final linear "
                         "layer to take features from); use an EfficientNet-Lite model.")
    classes = model.num_classes
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


async def serve_inference(request: Request, name: str) -> Response:
    """A place for the first image before the body is read (or 503), one more for each
    further image once the body says how many, every image through ``image_flow``."""
    state = state_of(request)
    engine = state.engine
    started = time.perf_counter()
    deadline = time.monotonic() + state.settings.request_timeout_s
    waits = not is_loaded(state, name)
    model = await find_model(state, name)
    with ExitStack() as places:
        first = places.enter_context(admit_after(state, model, deadline, waits))
        places.enter_context(in_time_left_by_load(model.name, waits))
        body = await _read_body(request)
        parsed = await state.pool.run_before(deadline, parse_request, body,
                                             request.headers.get(HEADER_LENGTH),
                                             model.preprocessing.crop,
                                             model.preprocessing.channels,
                                             EMBEDDING if model.task == EMBED else PROBABILITIES)
        del body
        plan = _plan(parsed, model)
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

