"""The on-disk result cache."""

from __future__ import annotations

import numpy as np

from app.cache import ResultCache, cache_key
from app.engine.predictor import Ranked


def ranked(seed: int) -> Ranked:
    scores = np.sort(np.random.default_rng(seed).random(1000).astype(np.float32))[::-1]
    return Ranked(np.arange(1000, dtype=np.int64), scores.copy())


def test_round_trip_keeps_the_full_ranking(tmp_path):
    cache = ResultCache(tmp_path, 10 * 1024**2)
    key = cache_key(b"image", "m", "v1")
    assert cache.get(key) is None
    cache.put(key, ranked(1))
    hit = cache.get(key)
    assert hit is not None
    assert np.array_equal(hit.indices, ranked(1).indices)
    assert np.array_equal(hit.scores, ranked(1).scores)
    assert np.array_equal(hit.top(3).scores, ranked(1).scores[:3])
    cache.close()
    reopened = ResultCache(tmp_path, 10 * 1024**2)
    assert reopened.get(key) is not None and len(reopened) == 1


def test_key_depends_on_bytes_model_and_weights():
    keys = {cache_key(b"a", "m", "v1"), cache_key(b"b", "m", "v1"),
            cache_key(b"a", "n", "v1"), cache_key(b"a", "m", "v2")}
    assert len(keys) == 4


def test_size_is_bounded(tmp_path):
    cache = ResultCache(tmp_path, 200 * 1024)
    for i in range(400):
        cache.put(cache_key(str(i).encode(), "m", "v"), ranked(i))
    # each entry is 8 KiB of ranking: about 25 fit in 200 KiB
    assert 10 <= len(cache) <= 60
    assert cache.get(cache_key(b"399", "m", "v")) is not None  # the newest survive
