"""A small client for the vramguard appliance (httpx only; no PyTorch, no NumPy).

>>> from vramguard_client import Client
>>> with Client() as vg:                    # finds the running appliance itself
...     print(vg.classify("coffee.jpg").top.label)
espresso
"""

from vramguard_client._async import AsyncClient
from vramguard_client._discovery import ServerLocation, find_server
from vramguard_client._errors import (
    BadImage,
    BadRequest,
    ClientClosed,
    Conflict,
    ConnectionLost,
    DeadlineExceeded,
    Forbidden,
    ImageTooComplex,
    ImageTooLarge,
    InsufficientMemory,
    InternalError,
    Loading,
    MethodNotAllowed,
    NotFound,
    NotReady,
    NotRunning,
    NotVramguard,
    Overloaded,
    Paused,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    Timeout,
    Unauthorized,
    Unavailable,
    UnexpectedResponse,
    UnsupportedMediaType,
    VramguardError,
)
from vramguard_client._protocol import ImageInput
from vramguard_client._sync import Client
from vramguard_client._types import (
    CacheRelease,
    Classification,
    Embedding,
    MemoryInfo,
    ModelInfo,
    Outcome,
    Prediction,
)
from vramguard_client._version import __version__

__all__ = [
    "AsyncClient",
    "BadImage",
    "BadRequest",
    "CacheRelease",
    "Classification",
    "Client",
    "ClientClosed",
    "Conflict",
    "ConnectionLost",
    "DeadlineExceeded",
    "Embedding",
    "Forbidden",
    "ImageInput",
    "ImageTooComplex",
    "ImageTooLarge",
    "InsufficientMemory",
    "InternalError",
    "Loading",
    "MemoryInfo",
    "MethodNotAllowed",
    "ModelInfo",
    "NotFound",
    "NotReady",
    "NotRunning",
    "NotVramguard",
    "Outcome",
    "Overloaded",
    "Paused",
    "PayloadTooLarge",
    "Prediction",
    "RateLimited",
    "RequestTimeout",
    "ServerLocation",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "UnexpectedResponse",
    "UnsupportedMediaType",
    "VramguardError",
    "__version__",
    "find_server",
]
