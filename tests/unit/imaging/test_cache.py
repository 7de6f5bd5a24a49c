"""The on-disk result cache."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import diskcache
import numpy as np
import pytest
from asgi import built_app, client, make_settings, png
from small_disk import fill, mounted

from app.engine.predictor import Ranked
from app.imaging.result_cache import (
    EMBEDDING_MAGIC,
    MAGIC,
    MAX_EMBEDDING_DIM,
    ResultCache,
    UnusableEntry,
    cache_key,
    decode_embedding,
    encode_embedding,
)


def ranked(seed: int) -> Ranked:
    scores = np.sort(np.random.default_rng(seed).random(1000).astype(np.float32))[::-1]
    return Ranked(np.arange(1000, dtype=np.int64), scores.copy())


def test_round_trip_keeps_the_full_ranking(tmp_path):
    cache = ResultCache(tmp_path, 10 * 1024**2)
    key = cache_key(b"image", "m", "v1", "cpu")
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
    keys = {cache_key(b"a", "m", "v1", "cpu"), cache_key(b"b", "m", "v1", "cpu"),
            cache_key(b"a", "n", "v1", "cpu"), cache_key(b"a", "m", "v2", "cpu")}
    assert len(keys) == 4


def test_size_is_bounded(tmp_path):
    cache = ResultCache(tmp_path, 200 * 1024)
    for i in range(400):
        cache.put(cache_key(str(i).encode(), "m", "v", "cpu"), ranked(i))
    # each entry is 8 KiB of ranking: about 25 fit in 200 KiB
    assert 10 <= len(cache) <= 60
    assert cache.get(cache_key(b"399", "m", "v", "cpu")) is not None  # the newest survive


# --- what another program may have left in the cache folder ----------------------------------


class Payload:
    """A pickle that runs code when loaded: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def plant(folder: Path, entries: dict[str, object], **settings: object) -> None:
    """Write ``entries`` into the cache folder as another program would: with diskcache's
    default Disk, which pickles what is not bytes, str or a number (in the database, or in
    a value file when large, unless ``settings`` say otherwise)."""
    with diskcache.Cache(str(folder), **settings) as foreign:
        for key, planted in entries.items():
            foreign.set(key, planted)


def cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "vramguard.cache" and r.levelno >= logging.WARNING]


def test_a_planted_pickle_is_never_loaded(tmp_path, caplog):
    marker = tmp_path / "code-ran"
    key, big = cache_key(b"image", "m", "v1", "cpu"), cache_key(b"big", "m", "v1", "cpu")
    folder = tmp_path / "cache"
    plant(folder, {key: Payload(marker),                        # in the database
                   big: [Payload(marker), "x" * 100_000]})      # in a value file
    assert list(folder.rglob("*.val"))
    cache = ResultCache(folder, 10 * 1024**2)
    assert cache.get(key) is None and cache.get(big) is None
    assert not marker.exists(), "the cache unpickled what it read"
    cache.put(key, ranked(1))  # the next answer replaces the planted entry
    hit = cache.get(key)
    assert hit is not None and np.array_equal(hit.scores, ranked(1).scores)
    cache.close()
    assert not marker.exists()
    assert len(cache_warnings(caplog)) == 1


@pytest.mark.anyio
async def test_the_classify_route_misses_a_planted_pickle_and_a_damaged_entry(tmp_path, caplog):
    marker = tmp_path / "code-ran"
    pickled, damaged = png(8), png(9)
    model = make_settings(tmp_path).model  # served by the stand-in engine's "stand-in" weights
    plant(tmp_path / "cache", {cache_key(pickled, model, "stand-in", "cpu"): Payload(marker),
                               cache_key(damaged, model, "stand-in", "cpu"): b"\x00garbage"})
    flags = []
    with built_app(tmp_path, ready=True, cache=True, rate_limit=False) as app:
        async with client(app) as http:
            for body in (pickled, damaged, pickled, damaged):
                answer = await http.post("/v1/classify", files={"file": ("a.png", body)})
                assert answer.status_code == 200, answer.text
                flags.append(answer.json()["cached"])
    assert not marker.exists(), "the cache unpickled what it read"
    assert flags == [False, False, True, True]  # misses, then the fresh answers are kept
    assert len(cache_warnings(caplog)) == 1


def test_an_entry_naming_another_file_neither_reads_nor_deletes_it(tmp_path):
    """diskcache opens, and on replacing the entry deletes, the file an entry names."""
    victim = tmp_path / "someone's-file"
    victim.write_bytes(b"precious")
    key = cache_key(b"image", "m", "v1", "cpu")
    plant(tmp_path / "cache", {key: b"x" * 100_000})  # a value file
    with sqlite3.connect(tmp_path / "cache" / "cache.db") as db:
        db.execute("UPDATE Cache SET filename = ?", (str(victim),))
    cache = ResultCache(tmp_path / "cache", 10 * 1024**2)
    assert cache.get(key) is None
    cache.put(key, ranked(1))
    assert cache.get(key) is not None
    cache.close()
    assert victim.read_bytes() == b"precious"


def header_and(indices: list[int], scores: list[float]) -> bytes:
    """An entry in vramguard's own format with the given contents."""
    return (MAGIC + np.asarray(indices, "<i4").tobytes() + np.asarray(scores, "<f4").tobytes())


@pytest.mark.parametrize("stored", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x80\x04garbage", id="garbage-bytes"),
    pytest.param("a string", id="text"),
    pytest.param(12345, id="a-number"),
    pytest.param(lambda: header_and([0, 1, 2], [0.5, 0.3]), id="lengths-differ"),
    pytest.param(lambda: header_and([0, 1, 1], [0.5, 0.3, 0.2]), id="repeated-class"),
    pytest.param(lambda: header_and([0, 1, 7], [0.5, 0.3, 0.2]), id="class-out-of-range"),
    pytest.param(lambda: header_and([0, 1, 2], [0.5, float("nan"), 0.2]), id="not-a-number"),
    pytest.param(lambda: MAGIC + b"\x01\x02\x03", id="truncated"),
])
def test_a_damaged_entry_is_a_miss_logged_once(tmp_path, caplog, stored):
    stored = stored() if callable(stored) else stored
    keys = [cache_key(str(i).encode(), "m", "v1", "cpu") for i in range(3)]
    plant(tmp_path, dict.fromkeys(keys, stored))
    cache = ResultCache(tmp_path, 10 * 1024**2)
    for key in keys * 2:
        assert cache.get(key) is None
    assert len(cache_warnings(caplog)) == 1
    assert "could not be used" in cache_warnings(caplog)[0]


def test_a_damaged_database_is_started_afresh(tmp_path, caplog):
    (tmp_path / "cache.db").write_bytes(b"not a database" * 100)
    cache = ResultCache(tmp_path, 10 * 1024**2)
    key = cache_key(b"image", "m", "v1", "cpu")
    assert cache.get(key) is None
    cache.put(key, ranked(1))
    assert cache.get(key) is not None
    cache.close()
    assert len(cache_warnings(caplog)) == 1 and "starting it afresh" in cache_warnings(caplog)[0]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_cache_folders_are_private(tmp_path):
    fresh = tmp_path / "new" / "results"
    ResultCache(fresh, 10 * 1024**2).close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    ResultCache(loose, 10 * 1024**2).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0,
                    reason="needs root to hand a folder to another user")
def test_a_folder_of_another_user_is_not_used(tmp_path, caplog):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    os.chown(theirs, 65534, 65534)
    cache = ResultCache(theirs, 10 * 1024**2)
    key = cache_key(b"image", "m", "v1", "cpu")
    cache.put(key, ranked(1))
    assert cache.get(key) is None and len(cache) == 0
    cache.close()
    assert list(theirs.iterdir()) == []
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o777  # not ours to change
    assert any("belongs to another user" in w for w in cache_warnings(caplog))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real, small filesystem (tmpfs, 1 MiB) to fill while the cache is open."""
    with mounted(tmp_path / "small", "1m") as mount:
        yield mount


@pytest.mark.anyio
async def test_a_disk_that_fills_up_serves_uncached_with_one_warning(tmp_path, small_disk,
                                                                      caplog):
    with built_app(tmp_path, ready=True, cache=True, cache_dir=small_disk / "cache",
                   rate_limit=False) as app:
        async with client(app) as http:
            fill(small_disk)
            flags = []
            for size in (8, 9, 10, 11, 8):
                answer = await http.post("/v1/classify", files={"file": ("a.png", png(size))})
                assert answer.status_code == 200, answer.text
                flags.append(answer.json()["cached"])
    assert flags == [False] * 5
    warnings = cache_warnings(caplog)
    assert len(warnings) == 1 and "disk is full" in warnings[0]


@pytest.mark.anyio
async def test_a_well_formed_entry_for_another_model_is_a_miss(tmp_path):
    """A ranking over more classes than the model has would name labels it lacks."""
    image = png(10)
    model = make_settings(tmp_path).model
    plant(tmp_path / "cache", {cache_key(image, model, "stand-in", "cpu"):
                               header_and(list(range(2000)), [0.0005] * 2000)})
    with built_app(tmp_path, ready=True, cache=True, rate_limit=False) as app:
        async with client(app) as http:
            answer = await http.post("/v1/classify", files={"file": ("a.png", image)})
    assert answer.status_code == 200, answer.text
    assert answer.json()["cached"] is False


def test_scores_computed_on_the_cpu_are_not_served_to_a_gpu(tmp_path):
    """A GPU's scores differ from the CPU's by about 1e-3 (TF32, other kernels): an answer
    computed on one device is not an answer from the other."""
    import dataclasses
    import time
    from types import SimpleNamespace

    import torch
    from tiny_model import tiny_model

    from app.api.image_flow import _prepare

    pixels = np.zeros((3, 16, 16), np.float32)
    state = SimpleNamespace(cache=ResultCache(tmp_path, 10 * 1024**2),
                            decoder=SimpleNamespace(decode=lambda *_: pixels))
    on_cpu = tiny_model()
    on_gpu = dataclasses.replace(on_cpu, device=torch.device("cuda", 0))
    deadline = time.monotonic() + 30
    key, found = _prepare(state, on_cpu, b"image", deadline)  # type: ignore[arg-type]
    assert key is not None and isinstance(found, torch.Tensor)
    state.cache.put(key, Ranked(np.arange(10), np.linspace(1, 0, 10, dtype=np.float32)))
    assert isinstance(_prepare(state, on_cpu, b"image", deadline)[1], Ranked)  # a repeat hits
    gpu_key, found = _prepare(state, on_gpu, b"image", deadline)  # type: ignore[arg-type]
    assert gpu_key != key and isinstance(found, torch.Tensor), "a CPU answer served on a GPU"
    state.cache.close()


def test_the_key_says_whether_tf32_was_allowed(monkeypatch):
    import torch

    from app.engine.predictor import numerics

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    with_tf32 = numerics(cuda)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert numerics(cuda) != with_tf32
    assert numerics(torch.device("cpu")) not in (with_tf32, numerics(cuda))
    keys = {cache_key(b"a", "m", "v1", n) for n in (with_tf32, numerics(cuda), "cpu")}
    assert len(keys) == 3


# --- embeddings --------------------------------------------------------------------------------


def unit(dim: int, seed: int = 0) -> np.ndarray:
    """A random float32 vector of L2 norm 1, as the embed route stores."""
    vec = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return vec / np.linalg.norm(vec)


def embed_key(data: bytes) -> str:
    return cache_key(data, "m", "v1", "cpu", task="embed")


def test_an_embedding_round_trips(tmp_path):
    cache = ResultCache(tmp_path, 10 * 1024**2)
    key = embed_key(b"image")
    assert cache.get_embedding(key) is None
    cache.put_embedding(key, unit(1280))
    cache.close()
    hit = ResultCache(tmp_path, 10 * 1024**2).get_embedding(key)
    assert hit is not None and hit.dtype == np.float32 and hit.shape == (1280,)
    assert np.array_equal(hit, unit(1280))


def test_an_embedding_read_back_is_the_callers_own_copy(tmp_path):
    cache = ResultCache(tmp_path, 10 * 1024**2)
    key = embed_key(b"image")
    cache.put_embedding(key, unit(1280))
    first = cache.get_embedding(key)
    assert first is not None and first.flags.writeable
    first[:] = 0
    assert np.array_equal(cache.get_embedding(key), unit(1280))


def test_classify_keys_are_unchanged_and_embed_keys_are_apart():
    classify = cache_key(b"image", "m", "v1", "cpu")
    # The format existing caches were written with: their entries must stay hits.
    assert classify == ("m:v1:cpu:"
                        "6105d6cc76af400325e94d588ce511be5bfdbb73b437dc51eca43917d7a43e3d")
    assert cache_key(b"image", "m", "v1", "cpu", task="classify") == classify
    embed = embed_key(b"image")
    assert embed != classify
    # Nor can a model name or numerics make some classify key read as this embed key.
    assert embed not in {cache_key(b"image", "embed", "m", "v1:cpu"),
                         cache_key(b"image", "m", "v1", "cpu:embed")}
    with pytest.raises(ValueError, match="unknown task"):
        cache_key(b"image", "m", "v1", "cpu", task="detect")


def test_a_ranking_is_no_embedding_and_an_embedding_no_ranking(tmp_path, caplog):
    cache = ResultCache(tmp_path, 10 * 1024**2)
    ranking_key, embedding_key = cache_key(b"a", "m", "v1", "cpu"), embed_key(b"b")
    cache.put(ranking_key, ranked(1))
    cache.put_embedding(embedding_key, unit(1280))
    assert cache.get_embedding(ranking_key) is None
    assert cache.get(embedding_key) is None
    assert cache.get(ranking_key) is not None  # each still answers as its own kind
    assert cache.get_embedding(embedding_key) is not None
    assert len(cache_warnings(caplog)) == 1


def unit_bytes(dim: int) -> bytes:
    return unit(dim).astype("<f4").tobytes()


def with_value(index: int, value: float) -> bytes:
    vec = unit(1280)
    vec[index] = value
    return EMBEDDING_MAGIC + vec.astype("<f4").tobytes()


@pytest.mark.parametrize("stored", [
    pytest.param(b"VGX1" + unit_bytes(1280), id="wrong-magic"),
    pytest.param(MAGIC + unit_bytes(1280), id="ranking-magic"),
    pytest.param(with_value(5, float("nan")), id="not-a-number"),
    pytest.param(with_value(5, float("inf")), id="infinite"),
    pytest.param(EMBEDDING_MAGIC + (2 * unit(1280)).astype("<f4").tobytes(),
                 id="not-normalised"),
    pytest.param(EMBEDDING_MAGIC + unit_bytes(1280) + b"\x00\x00", id="odd-length"),
    pytest.param(EMBEDDING_MAGIC, id="0-d"),
    pytest.param(EMBEDDING_MAGIC + unit_bytes(70_000), id="70000-d"),
])
def test_a_planted_embedding_is_a_miss_logged_once(tmp_path, caplog, stored):
    keys = [embed_key(str(i).encode()) for i in range(3)]
    plant(tmp_path, dict.fromkeys(keys, stored), disk_min_file_size=2**30)  # in the database
    cache = ResultCache(tmp_path, 10 * 1024**2)
    for key in keys * 2:
        assert cache.get_embedding(key) is None
    assert len(cache_warnings(caplog)) == 1
    assert "could not be used" in cache_warnings(caplog)[0]


@pytest.mark.parametrize("stored", [
    pytest.param(EMBEDDING_MAGIC + unit_bytes(1), id="1-d"),
    pytest.param(EMBEDDING_MAGIC + unit_bytes(MAX_EMBEDDING_DIM), id="65536-d"),
    pytest.param(EMBEDDING_MAGIC + (unit(1280) * (1 + 5e-4)).astype("<f4").tobytes(),
                 id="norm-within-tolerance"),
])
def test_an_embedding_at_the_limits_is_a_hit(tmp_path, stored):
    key = embed_key(b"image")
    plant(tmp_path, {key: stored}, disk_min_file_size=2**30)
    hit = ResultCache(tmp_path, 10 * 1024**2).get_embedding(key)
    assert hit is not None and hit.tobytes() == stored[len(EMBEDDING_MAGIC):]


def test_decode_embedding_names_the_problem():
    with pytest.raises(UnusableEntry, match="norm"):
        decode_embedding(EMBEDDING_MAGIC + (2 * unit(8)).astype("<f4").tobytes())


def test_a_planted_pickle_under_an_embed_key_is_never_loaded(tmp_path):
    marker = tmp_path / "code-ran"
    key = embed_key(b"image")
    plant(tmp_path / "cache", {key: Payload(marker)})
    assert ResultCache(tmp_path / "cache", 10 * 1024**2).get_embedding(key) is None
    assert not marker.exists(), "the cache unpickled what it read"


@pytest.mark.parametrize("vec", [
    pytest.param(2 * unit(1280), id="not-normalised"),
    pytest.param(np.zeros(1280, np.float32), id="zero"),
    pytest.param(unit(1280).reshape(1, 1280), id="a-batch-of-one"),
    pytest.param(np.float32(1.0), id="0-d"),
])
def test_an_embedding_that_would_not_be_read_back_is_not_kept(tmp_path, caplog, vec):
    with pytest.raises(ValueError, match="not kept"):
        encode_embedding(vec)
    cache = ResultCache(tmp_path, 10 * 1024**2)
    for key in (embed_key(b"a"), embed_key(b"b")):
        cache.put_embedding(key, vec)
        assert cache.get_embedding(key) is None
    assert len(cache) == 0
    assert len(cache_warnings(caplog)) == 1 and "not cached" in cache_warnings(caplog)[0]


def test_a_full_disk_does_not_fail_embeddings(small_disk, caplog):
    cache = ResultCache(small_disk / "cache", 10 * 1024**2)
    fill(small_disk)
    keys = [embed_key(str(i).encode()) for i in range(3)]
    for i, key in enumerate(keys):
        cache.put_embedding(key, unit(1280, seed=i))
    assert [cache.get_embedding(key) for key in keys] == [None] * 3
    cache.close()
    warnings = cache_warnings(caplog)
    assert len(warnings) == 1 and "cannot be written" in warnings[0]


def test_a_locked_database_does_not_fail_embeddings(tmp_path, monkeypatch, caplog):
    """Another program holds the write lock longer than the store waits for it (diskcache's
    60 s, shortened here to keep the test fast). Reads go on meanwhile (WAL)."""
    monkeypatch.setattr(diskcache, "Cache", functools.partial(diskcache.Cache, timeout=0.1))
    cache = ResultCache(tmp_path, 10 * 1024**2)
    kept, refused = embed_key(b"kept"), embed_key(b"refused")
    cache.put_embedding(kept, unit(1280))
    with contextlib.closing(sqlite3.connect(tmp_path / "cache.db", isolation_level=None)) as other:
        other.execute("BEGIN EXCLUSIVE")
        cache.put_embedding(refused, unit(1280, seed=1))
        cache.put(cache_key(b"refused", "m", "v1", "cpu"), ranked(1))  # the same write path
        assert np.array_equal(cache.get_embedding(kept), unit(1280))
        other.execute("ROLLBACK")
    assert cache.get_embedding(refused) is None
    cache.close()
    warnings = cache_warnings(caplog)
    assert len(warnings) == 1 and "cannot be written" in warnings[0]
