"""Result cache on disk (diskcache): the same image bytes are never classified twice.

Desktop apps re-scan the same folders often. The key is the SHA-256 of the
image bytes plus the model name and its weights fingerprint; the value is the
full ranking, so one entry answers any later ``top_k``. Size-bounded; the
oldest entries are evicted first.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
from pathlib import Path

import diskcache
import numpy as np

from app.engine.predictor import Ranked

log = logging.getLogger("vramguard.cache")
STORE_ERRORS = (OSError, sqlite3.Error)  # a full disk, a damaged or locked database


def cache_key(data: bytes, model: str, weights_version: str) -> str:
    return f"{model}:{weights_version}:{hashlib.sha256(data).hexdigest()}"


class ResultCache:
    """Thread-safe; call it from the CPU pool, never from the event loop (disk I/O)."""

    def __init__(self, directory: Path, size_limit: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._cache = diskcache.Cache(str(directory), size_limit=size_limit)

    def get(self, key: str) -> Ranked | None:
        """The cached ranking, or None; a cache that cannot be read is a miss, not an
        error: the model can still answer."""
        try:
            value = self._cache.get(key)
        except STORE_ERRORS as exc:
            log.warning("the result cache cannot be read (%s); computing the answer", exc)
            return None
        if value is None:
            return None
        indices, scores = value
        return Ranked(np.frombuffer(indices, dtype=np.int32), np.frombuffer(scores, np.float32))

    def put(self, key: str, ranked: Ranked) -> None:
        value = (ranked.indices.astype(np.int32).tobytes(),
                 ranked.scores.astype(np.float32).tobytes())
        try:
            self._cache.set(key, value)
        except STORE_ERRORS as exc:  # the answer still goes out; only the cache misses it
            log.warning("the result cache cannot be written (%s); is the disk full?", exc)

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._cache.close()
