"""The models folder: own models arrive, are listed, are checked once, and leave.

Each model is a sub-folder named as the model (the catalogue's name, the only name the
API knows: no path ever comes from HTTP). ``add`` copies a folder in under a hidden
name, runs the trial on the copy (what is checked is what will be served), and renames
it into place: a failure leaves nothing. A folder put there by hand is found by the
next ``scan`` (cheap: one directory read and a stat per model, and a folder is read
again only when its files change) and must pass the same trial before it is loaded; a
broken one is listed with its error and does not stop the others. A trial's verdict is
kept per content fingerprint, so an unchanged folder is checked once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.models.own.description import ModelDescription, describe_folder
from app.models.own.folder_files import links_out
from app.models.own.manifest import FolderError
from app.models.own.trial import TrialResult, run_trial

log = logging.getLogger("vramguard.models")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
HIDDEN = "."  # names the store itself uses: incoming copies, removals, verdicts
VERDICTS = ".checked"
SCAN_EVERY_S = 3.0
MISS_RESCAN_S = 0.25  # an unknown name rescans the folder at most this often
Trial = Callable[[Path, str], TrialResult]


@dataclass(frozen=True)
class OwnEntry:
    """One folder of the models folder: its model, or why it cannot be served."""

    name: str
    folder: Path
    description: ModelDescription | None
    error: str = ""


def check_name(name: str, reserved: Callable[[str], bool] = lambda _: False) -> str:
    """``name`` when it may name an own model; FolderError saying why not."""
    if not NAME_RE.match(name):
        raise FolderError(f"'{name}' cannot name a model: use 1 to 64 lower-case letters, "
                          "digits, dots, dashes or underscores, starting with a letter or "
                          "digit")
    if reserved(name):
        raise FolderError(f"'{name}' is the name of a built-in model; choose another with "
                          "--name")
    return name


def fingerprint_folder(folder: Path) -> str:
    """A hash of every file's name and content: the result cache's and profiles' key."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder).as_posix()).encode() + b"\0")
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _stamp(folder: Path) -> tuple[int, ...]:
    """Changes when a file of the folder is added, removed, replaced or rewritten."""
    stamps = [folder.stat().st_mtime_ns]
    with os.scandir(folder) as found:
        for entry in found:
            stat = entry.stat(follow_symlinks=False)
            stamps += [stat.st_mtime_ns, stat.st_size, stat.st_ino]
    return tuple(stamps)


class OwnModels:
    """The models folder of one vramguard; thread-safe (the event loop scans, the device
    thread and the trial's thread read)."""

    def __init__(self, root: Path, *, timeout_s: float = 120.0, trial: Trial | None = None,
                 reserved: Callable[[str], bool] = lambda _: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.timeout_s = timeout_s
        self._trial = trial or (lambda folder, form: run_trial(folder, form,
                                                               timeout_s=self.timeout_s))
        self._reserved = reserved
        self._clock = clock
        self._lock = threading.Lock()
        self._scanned_at = -SCAN_EVERY_S
        self._entries: dict[str, OwnEntry] = {}
        self._stamps: dict[str, tuple[int, ...]] = {}
        self._versions: dict[str, str] = {}  # fingerprints, until the folder's stamp changes

    # -- listing -------------------------------------------------------------------------

    def scan(self, force: bool = False) -> list[OwnEntry]:
        """Every model folder, sorted by name; read again at most every few seconds
        unless ``force``."""
        with self._lock:
            now = self._clock()
            if force or now - self._scanned_at >= SCAN_EVERY_S:
                self._rescan()
                self._scanned_at = now
            return [self._entries[name] for name in sorted(self._entries)]

    def get(self, name: str) -> OwnEntry | None:
        """The entry named exactly ``name``, from the latest scan (scanning if due). A name
        not there is looked for again at once, at most every MISS_RESCAN_S (a model just
        added answers its first request; a flood of unknown names costs one scan in that
        time)."""
        found = next((e for e in self.scan() if e.name == name), None)
        if found is None:
            with self._lock:
                due = self._clock() - self._scanned_at >= MISS_RESCAN_S
            if due:
                found = next((e for e in self.scan(force=True) if e.name == name), None)
        return found

    def stamp(self, name: str) -> tuple[int, ...] | None:
        """The folder's sizes and change times at the latest scan (scanning if due): a
        different stamp means a different folder; None once it has gone."""
        entry = self.get(name)
        with self._lock:
            return None if entry is None else self._stamps.get(name)

    def _rescan(self) -> None:
        try:
            with os.scandir(self.root) as found:
                folders = {e.name: Path(e.path) for e in found
                           if not e.name.startswith(HIDDEN) and e.is_dir()}
        except OSError:
            folders = {}
        for name in set(self._entries) - set(folders):
            self._entries.pop(name)
            self._stamps.pop(name, None)
            self._versions.pop(name, None)
        for name, folder in folders.items():
            try:
                stamp = _stamp(folder)
            except OSError:
                continue
            if self._stamps.get(name) == stamp:
                continue
            self._stamps[name] = stamp
            self._versions.pop(name, None)
            self._entries[name] = self._describe(name, folder)

    def _describe(self, name: str, folder: Path) -> OwnEntry:
        try:
            check_name(name, self._reserved)
            outside = links_out(folder)
            if outside:
                raise FolderError(f"{', '.join(outside)} links outside the folder")
            return OwnEntry(name, folder, describe_folder(folder))
        except FolderError as exc:
            return OwnEntry(name, folder, None, str(exc))
        except OSError as exc:
            return OwnEntry(name, folder, None, f"The folder cannot be read: {exc}")

    # -- the trial, once per content -----------------------------------------------------

    def ensure_checked(self, name: str) -> str:
        """The model's fingerprint once its folder has passed the trial (now or before);
        FolderError when it does not pass or cannot be served."""
        entry = self.get(name)
        if entry is None:
            raise FolderError(f"There is no model '{name}' in {self.root}")
        if entry.description is None:
            raise FolderError(entry.error)
        with self._lock:  # hashed once per content: the check and the load both ask
            version = self._versions.get(name)
        if version is None:
            version = fingerprint_folder(entry.folder)
            with self._lock:
                self._versions[name] = version
        verdict = self.root / VERDICTS / f"{name}.json"
        try:
            if json.loads(verdict.read_text(encoding="utf-8")).get("version") == version:
                return version
        except (OSError, ValueError, AttributeError):
            pass
        result = self._trial(entry.folder, entry.description.format)
        self._keep_verdict(name, version, result)
        return version

    def _keep_verdict(self, name: str, version: str, result: TrialResult) -> None:
        directory = self.root / VERDICTS
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": version, "outputs": result.outputs,
                           "seconds": round(result.seconds, 2),
                           "peak_bytes": result.peak_bytes})
        handle, temp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temp, directory / f"{name}.json")

    # -- arriving and leaving ------------------------------------------------------------

    def add(self, source: Path, name: str | None = None) -> OwnEntry:
        """Copy ``source`` in as ``name`` (default: its folder's name) once a copy of it
        has passed the trial; nothing is left behind when it does not."""
        name = check_name(source.name.lower() if name is None else name, self._reserved)
        if not source.is_dir():
            raise FolderError(f"{source} is not a folder")
        outside = links_out(source)
        if outside:
            raise FolderError(f"{', '.join(outside)} in {source} links outside the folder; "
                              "copy the files into it instead")
        describe_folder(source)  # the cheap checks, before anything is copied
        target = self.root / name
        if target.exists():
            raise FolderError(f"A model named '{name}' is already there; remove it first "
                              f"(vramguard models remove {name}) or choose another --name")
        self.root.mkdir(parents=True, exist_ok=True)
        incoming = Path(tempfile.mkdtemp(dir=self.root, prefix=f"{HIDDEN}incoming-"))
        try:
            copy = incoming / name
            shutil.copytree(source, copy, symlinks=False)
            described = describe_folder(copy)
            result = self._trial(copy, described.format)
            os.rename(copy, target)
        except FileExistsError:
            raise FolderError(f"A model named '{name}' arrived meanwhile") from None
        except OSError as exc:
            raise FolderError(f"Copying the folder failed: {exc}") from None
        finally:
            shutil.rmtree(incoming, ignore_errors=True)
        self._keep_verdict(name, fingerprint_folder(target), result)
        log.info("model %s added from %s (%s, %d outputs, checked in %.1f s)", name, source,
                 described.format, result.outputs, result.seconds)
        return OwnEntry(name, target, described)

    def remove(self, name: str) -> None:
        """Take ``name``'s folder away (moved aside first, so a half-deleted folder is
        never listed)."""
        target = self.root / check_name(name)
        if not target.is_dir():
            raise FolderError(f"There is no model '{name}' in {self.root}")
        aside = self.root / f"{HIDDEN}removing-{name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(target, aside)
        shutil.rmtree(aside, ignore_errors=True)
        (self.root / VERDICTS / f"{name}.json").unlink(missing_ok=True)
        with self._lock:
            self._scanned_at = -SCAN_EVERY_S
