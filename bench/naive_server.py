"""The baseline: the common way to serve a model, on the same model and API.

An ``async def`` route that reads the body, decodes, preprocesses and runs the
model inline: it blocks the event loop, runs one image at a time and never
batches. Same decoding, preprocessing and model as vramguard, so the
comparison measures only the serving design.

Run: python -m bench.naive_server --port 8766
"""

from __future__ import annotations

import argparse

import torch
import uvicorn
from fastapi import FastAPI, Request

from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models import DEFAULT_MODEL, load_model


def create_naive_app(model_name: str = DEFAULT_MODEL) -> FastAPI:
    model = load_model(model_name, torch.device("cpu"))
    app = FastAPI()

    @app.post("/v1/classify")
    async def classify(request: Request, top_k: int = 5) -> dict[str, object]:
        data = await request.body()
        spec = model.preprocessing
        pixels = torch.from_numpy(model_input(open_image(data, 40_000_000, spec.resize), spec))
        with torch.inference_mode():
            probs = model.module(pixels[None]).softmax(-1)[0]
        scores, indices = probs.topk(top_k)
        return {"model": model.name, "batch_size": 1, "cached": False,
                "predictions": [{"label": model.labels[int(i)], "index": int(i),
                                 "score": float(s)} for s, i in zip(scores, indices, strict=True)]}

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    uvicorn.run(create_naive_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
