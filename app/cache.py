"""Result cache on disk (diskcache): the same image bytes are never classified twice.

Desktop apps re-scan the same folders often. The key is the SHA-256 of the
image bytes plus the model name and its weights fingerprint; the value is the
full ranking, so one entry answers any later ``top_k``. Size-bounded; the
oldest entries are evicted first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import diskcache
import numpy as np

from app.engine.predictor import Ranked


def cache_key(data: bytes, model: str, weights_version: str) -> str:
    return f"{model}:{weights_version}:{hashlib.sha256(data).hexdigest()}"


class ResultCache:
    """Thread-safe; call it from the CPU pool, never from the event loop (disk I/O)."""

    def __init__(self, directory: Path, size_limit: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._cache = diskcache.Cache(str(directory), size_limit=size_limit)

    def get(self, key: str) -> Ranked | None:
        value = self._cache.get(key)
        if value is None:
            return None
        indices, scores = value
        return Ranked(np.frombuffer(indices, dtype=np.int32), np.frombuffer(scores, np.float32))

    def put(self, key: str, ranked: Ranked) -> None:
        value = (ranked.indices.astype(np.int32).tobytes(),
                 ranked.scores.astype(np.float32).tobytes())
        self._cache.set(key, value)

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._cache.close()
