"""Response bodies of the Open Inference Protocol routes (``app/api/oip.py``), as the
KServe v2 / Triton HTTP protocol names their fields; they document /v2 in /docs."""

from __future__ import annotations

from pydantic import BaseModel, Field


class OipError(BaseModel):
    """Every failure under /v2, including the gates' refusals (the protocol's shape)."""

    error: str


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str] = Field(description="The protocol extensions this server "
                                  "implements.")


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1: any length (the batch, or a length known "
                             "only once the model is loaded).")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata] = Field(description="A request sends exactly one of them.")
    outputs: list[TensorMetadata]


class ModelReady(BaseModel):
    name: str
    ready: bool
    loaded: bool = Field(description="Whether it is loaded now; a ready model that is not "
                         "is loaded by its first inference request.")


class OutputTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float] | list[str] | None = Field(None, description="Row-major values, "
                                                 "unless sent as binary data after the "
                                                 "JSON header.")
    parameters: dict[str, int] | None = Field(None, description="binary_data_size: bytes "
                                              "of this output after the JSON header.")


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[OutputTensor]
