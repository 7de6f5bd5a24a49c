"""Result cache on disk (diskcache): the same image bytes are never run twice.

Desktop apps re-scan the same folders often. The key is the SHA-256 of the
image bytes plus the model name, its weights fingerprint, the numerics it ran with
(device type, TF32) and the task (classify or embed). A classify value is the full
ranking, so one entry answers any later ``top_k``; an embed value is the unit vector.
Size-bounded; the oldest entries are evicted first.

Nothing read back from the folder is trusted, because any program that can write
there can put anything in it. A value is plain bytes in one of vramguard's own formats
(a ranking: ``MAGIC``, the class indices as little-endian int32, the scores as float32;
an embedding: ``EMBEDDING_MAGIC``, the values as little-endian float32), always kept
inside the database, and is read back only in the form its caller asked for:
diskcache's pickling is never reached (``_BytesOnlyDisk``). An entry in any other
form, damaged, foreign, of the other task, or written with pickle by an older
vramguard, is a miss, logged once, and replaced when its image is run again. The
folder is private (0700): its keys tell which images were seen.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import sqlite3
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import diskcache
import numpy as np
import numpy.typing as npt
from diskcache.core import MODE_RAW

from app.engine.predictor import Ranked
from app.host.user_files import reason

log = logging.getLogger("vramguard.cache")
# A full disk, a damaged or locked database.
STORE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
MAGIC = b"VGR1"  # format 1 of a stored ranking
EMBEDDING_MAGIC = b"VGE1"  # format 1 of a stored embedding
MAX_EMBEDDING_DIM = 65536
# Stored embeddings were L2-normalised; float32 rounding moves the norm by far less.
NORM_TOLERANCE = 1e-3
TASKS = ("classify", "embed")
DATABASE_FILES = ("cache.db", "cache.db-wal", "cache.db-shm")
# Where diskcache's stock Disk writes value files (older vramguards' large pickles).
_VALUE_FILE = re.compile(r"[0-9a-f]{2}[/\\][0-9a-f]{2}[/\\][0-9a-f]{28}\.val")
_Value = TypeVar("_Value")


def cache_key(data: bytes, model: str, weights_version: str, numerics: str,
              task: str = "classify") -> str:
    """``numerics`` is ``predictor.numerics(device)``: the device type and TF32 setting,
    since a GPU's scores differ from the CPU's by about 1e-3.

    ``task`` keeps an image's embedding and ranking in separate entries. A classify key
    is the format of older vramguards, so their entries stay valid; an embed key ends in
    ``:embed``, which a classify key, ending in the 64 hex digits of the hash, never does,
    whatever the model name holds."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {TASKS}")
    key = f"{model}:{weights_version}:{numerics}:{hashlib.sha256(data).hexdigest()}"
    return key if task == "classify" else f"{key}:{task}"


class UnusableEntry(ValueError):
    """An entry not in the vramguard format asked for: foreign, older, of the other task
    or damaged."""


def encode(ranked: Ranked) -> bytes:
    return (MAGIC + ranked.indices.astype("<i4").tobytes()
            + ranked.scores.astype("<f4").tobytes())


def decode(stored: bytes) -> Ranked:
    """The ranking in ``stored``, checked to be a full one (every class once, finite
    scores) so that a planted entry cannot make the route fail on an odd class or score."""
    body = stored[len(MAGIC):]
    if not stored.startswith(MAGIC) or not body or len(body) % 8:
        raise UnusableEntry("not a ranking in vramguard's format")
    count = len(body) // 8
    indices = np.frombuffer(body, "<i4", count)
    scores = np.frombuffer(body, "<f4", count, offset=4 * count)
    if not np.array_equal(np.sort(indices), np.arange(count)):
        raise UnusableEntry("a ranking that does not list every class once")
    if not np.isfinite(scores).all():
        raise UnusableEntry("a ranking with scores that are not numbers")
    return Ranked(indices, scores)


def _embedding_fault(vec: npt.NDArray[Any]) -> str | None:
    """Why ``vec`` is not an embedding vramguard would have stored, or None: a planted one
    must not make the route fail or answer with a vector no model computed."""
    if vec.ndim != 1 or not 1 <= vec.size <= MAX_EMBEDDING_DIM:
        return f"an embedding of shape {vec.shape}"
    if not np.isfinite(vec).all():
        return "an embedding with values that are not numbers"
    norm = float(np.linalg.norm(vec.astype(np.float64)))
    if abs(norm - 1.0) > NORM_TOLERANCE:
        return f"an embedding of norm {norm:.6g}, not a unit vector"
    return None


def encode_embedding(vec: npt.NDArray[np.floating[Any]]) -> bytes:
    """``vec`` as float32; ValueError for one that ``decode_embedding`` would refuse,
    since such an entry would only take space."""
    values = np.asarray(vec, "<f4")
    fault = _embedding_fault(values)
    if fault is not None:
        raise ValueError(f"{fault} is not kept")
    return EMBEDDING_MAGIC + values.tobytes()


def decode_embedding(stored: bytes) -> npt.NDArray[np.float32]:
    """The unit vector in ``stored``, checked like a ranking (see ``_embedding_fault``).
    A writable copy, so that a caller changing it cannot reach ``stored``."""
    body = stored[len(EMBEDDING_MAGIC):]
    if not stored.startswith(EMBEDDING_MAGIC) or len(body) % 4:
        raise UnusableEntry("not an embedding in vramguard's format")
    values = np.frombuffer(body, "<f4")
    fault = _embedding_fault(values)
    if fault is not None:
        raise UnusableEntry(fault)
    return values.astype(np.float32)


class _BytesOnlyDisk(diskcache.Disk):  # type: ignore[misc]  # diskcache ships no types
    """diskcache's storage reduced to str keys and bytes values inside the database.

    The stock Disk unpickles any key or value whose stored mode says pickle, and opens,
    and on eviction deletes, whatever file path an entry names: both are refused here.
    """

    def __init__(self, directory: str, **_settings: object) -> None:
        # The disk_* settings come from the folder's database: none of them is wanted.
        super().__init__(directory)

    def put(self, key: object) -> tuple[str, bool]:
        if type(key) is not str:
            raise TypeError("result cache keys are str")
        return key, True

    def get(self, key: object, raw: bool) -> str:
        if raw and type(key) is str:
            return key
        raise UnusableEntry("a key that vramguard did not write")

    def store(self, value: object, read: bool, key: object = None
              ) -> tuple[int, int, None, memoryview]:
        if read or type(value) is not bytes:
            raise TypeError("result cache values are bytes")
        return 0, MODE_RAW, None, sqlite3.Binary(value)

    def fetch(self, mode: object, filename: object, value: object, read: bool) -> bytes:
        if mode != MODE_RAW or filename is not None or read or type(value) is not bytes:
            raise UnusableEntry("an entry in another format: damaged, foreign or older")
        return value

    def remove(self, file_path: object) -> None:
        if isinstance(file_path, str) and _VALUE_FILE.fullmatch(file_path):
            super().remove(file_path)


def _private_folder(directory: Path) -> None:
    """Create ``directory`` 0700, or make it so: the keys tell which images were seen.
    A folder of another user is refused, since that user could write anything there."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.name != "posix":
        return  # a folder in the user's profile is private by its ACL
    info = directory.stat()
    if info.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, "it belongs to another user", str(directory))
    if stat.S_IMODE(info.st_mode) & 0o077:
        directory.chmod(0o700)


class ResultCache:
    """Thread-safe; call it from the CPU pool, never from the event loop (disk I/O).

    Never fails a request: whatever goes wrong with the folder makes a miss, or a result
    not kept, with one warning per kind of problem (then debug lines)."""

    def __init__(self, directory: Path, size_limit: int) -> None:
        self._directory = directory
        self._size_limit = size_limit
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        self._cache = self._open()

    def _open_store(self) -> diskcache.Cache:
        _private_folder(self._directory)
        # Every setting given, so none is taken from the folder's own Settings table.
        settings = {**diskcache.DEFAULT_SETTINGS, "size_limit": self._size_limit}
        return diskcache.Cache(str(self._directory), disk=_BytesOnlyDisk, **settings)

    def _open(self) -> diskcache.Cache | None:
        """The store; started afresh once if its database is damaged; None (no cache)
        when the folder cannot be used."""
        try:
            return self._open_store()
        except (OSError, sqlite3.OperationalError, diskcache.Timeout) as exc:
            self._give_up(exc)
            return None
        except Exception as exc:  # any way a damaged or foreign database fails to open
            log.warning("the result cache in %s is damaged (%s); starting it afresh",
                        self._directory, str(exc))
        try:
            for name in DATABASE_FILES:
                (self._directory / name).unlink(missing_ok=True)
            return self._open_store()
        except Exception as exc:
            self._give_up(exc)
            return None

    def _give_up(self, exc: Exception) -> None:
        why = reason(exc) if isinstance(exc, OSError) else str(exc)
        log.warning("cannot use the result cache in %s: %s (or set cache_dir). Running "
                    "without the result cache for now.", self._directory, why)

    def _once(self, problem: str, message: str, *args: object) -> None:
        """Log ``message`` as a warning the first time ``problem`` occurs, then as debug:
        one bad entry or a full disk would otherwise log on every request. Pass errors as
        text: a kept record must not hold their tracebacks, and with them the database."""
        with self._lock:
            first = problem not in self._reported
            self._reported.add(problem)
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def get(self, key: str) -> Ranked | None:
        """The cached ranking, or None; a cache that cannot be read, or an entry that
        cannot be used, is a miss, not an error: the model can still answer."""
        return self._get(key, decode)

    def get_embedding(self, key: str) -> npt.NDArray[np.float32] | None:
        """The cached embedding, a writable copy, or None, as ``get``: a ranking under
        ``key`` is a miss too."""
        return self._get(key, decode_embedding)

    def _get(self, key: str, decode_value: Callable[[bytes], _Value]) -> _Value | None:
        """The one read path of both value kinds, so that they fail alike."""
        if self._cache is None:
            return None
        try:
            stored = self._cache.get(key)
            return None if stored is None else decode_value(stored)
        except STORE_ERRORS as exc:
            self._once("read", "the result cache cannot be read (%s); computing the answers",
                       str(exc))
        except Exception as exc:  # diskcache trusts its folder; see the module docstring
            self._once("entry", "some entries in the result cache in %s could not be used "
                       "(%s); they are ignored and replaced as their images come again",
                       self._directory, str(exc))
        return None

    def put(self, key: str, ranked: Ranked) -> None:
        """Keep ``ranked``; when it cannot be kept the answer still goes out, uncached."""
        self._put(key, encode(ranked))

    def put_embedding(self, key: str, vec: npt.NDArray[np.floating[Any]]) -> None:
        """Keep ``vec``, as ``put``; one that would not be read back (not a unit vector)
        is not kept either: a warning, since the engine should not make it."""
        try:
            stored = encode_embedding(vec)
        except ValueError as exc:
            self._once("unfit", "an embedding was not cached: %s", str(exc))
            return
        self._put(key, stored)

    def _put(self, key: str, stored: bytes) -> None:
        """The one write path of both value kinds, so that they fail alike."""
        if self._cache is None:
            return
        try:
            self._cache.set(key, stored)
        except STORE_ERRORS as exc:
            self._once("write", "the result cache cannot be written (%s); is the disk full? "
                       "Answers are not cached until there is space", str(exc))
        except Exception as exc:  # a damaged or foreign database
            self._once("damaged", "the result cache in %s cannot keep answers (%s); delete "
                       "that folder to start it afresh", self._directory, str(exc))

    def __len__(self) -> int:
        if self._cache is None:
            return 0
        try:
            return len(self._cache)
        except Exception:  # a count that cannot be read is shown as empty, not an error
            return 0

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
