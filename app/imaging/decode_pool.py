"""Decode worker processes: untrusted images are opened there, never in the server.

One process per CPU-pool thread; the thread that runs a job hands the image bytes
to an idle process and waits for the model's crop, which it normalises. A process is killed, and
a fresh one started in its place, when its image passes the CPU-time limit or the
request's deadline, or it dies (a crash in a native decoder): the request gets a
clear error and the server keeps serving. Before decoding, each image's predicted
peak memory is reserved from the decode-memory budget; a burst of large images is
refused (503) instead of swelling the machine.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from typing import Any

import numpy as np
import psutil

from app.errors import (
    ApiError,
    BadImage,
    ImageTooComplex,
    ImageTooLarge,
    Overloaded,
    too_busy_to_start,
)
from app.imaging.decode_worker import READY, serve
from app.imaging.pixels import normalise
from app.preprocessing import Preprocessing

log = logging.getLogger("vramguard.decode")
MIN_WAIT_S = 0.005  # the shortest wait between two readings of a decode's CPU time
MIB = 1024**2
# Beyond an image's own predicted peak, what a worker's address space may grow by: the
# bytes as they arrive through the pipe, and room for fragmentation.
_SLACK_BYTES = 64 * MIB
# Reserved before each image is sent, so that an ordinary photo (a 12-megapixel JPEG
# decoded at a reduced scale peaks at a few MiB) needs no second round trip to ask.
PREGRANT_BYTES = 32 * MIB
_CRASHED = ("vramguard's image decoder crashed while reading this file, which is probably "
            "damaged. Other images are not affected; try another copy of this one.")


@dataclass(frozen=True)
class DecodeLimits:
    """What one decode may use; from the settings."""

    max_pixels: int
    max_image_bytes: int  # predicted peak memory of one image
    cpu_s: float  # CPU seconds one image may take
    max_body_bytes: int  # the largest upload, which a worker must be able to receive


class DecodeReservations:
    """Bytes that decodes in flight have reserved (their predicted peaks), against a total."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes if they fit; False (nothing taken) if not."""
        with self._lock:
            if self.used + size > self.total:
                return False
            self.used += size
            return True

    def release(self, size: int) -> None:
        with self._lock:
            self.used -= size


class _WorkerGone(Exception):
    """The worker process died, or was killed, before it answered."""


class _Stopped(Exception):
    """The worker was stopped mid-job; ``error`` is what the client is told."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class DecoderFailed(RuntimeError):
    """A decoder raised something unexpected (a bug, not a bad image); answered as 500."""


class Worker:
    """One decode process and the server's end of its pipe."""

    def __init__(self, memory_allowance: int | None) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process: SpawnProcess = context.Process(
            target=serve, args=(child_end, memory_allowance), name="vramguard-decode",
            daemon=True)
        self.process.start()
        child_end.close()
        self.ready = False
        self._usage = psutil.Process(self.process.pid)

    def cpu_seconds(self) -> float:
        """CPU time the process has used so far (user + system)."""
        try:
            times = self._usage.cpu_times()
        except psutil.Error:
            raise _WorkerGone from None
        return float(times.user + times.system)

    def send(self, message: object) -> None:
        try:
            self.conn.send(message)
        except OSError:  # the pipe is closed: the process has died
            raise _WorkerGone from None

    def receive(self, timeout: float) -> tuple[bool, Any]:
        """(True, message) if one arrives within ``timeout`` seconds, else (False, None)."""
        try:
            if not self.conn.poll(max(0.0, timeout)):
                return False, None
            return True, self.conn.recv()
        except (EOFError, OSError):
            raise _WorkerGone from None

    def ask_to_stop(self) -> None:
        with suppress(OSError):
            self.conn.send(None)

    def end(self, *, kill: bool) -> None:
        """Kill the process (or wait briefly for it to end by itself) and close the pipe."""
        if kill:
            self.process.kill()
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=2)
        self.conn.close()


class DecodePool:
    """One decode process per caller at a time, ``workers`` of them when the callers are
    the CPU pool's threads; started when first needed, or all at once by ``start``."""

    def __init__(self, workers: int, limits: DecodeLimits, budget_bytes: int) -> None:
        self.workers = workers
        self.limits = limits
        self.reservations = DecodeReservations(budget_bytes)
        self.memory_allowance = limits.max_image_bytes + limits.max_body_bytes + _SLACK_BYTES
        self.replaced = 0  # processes killed or lost, each replaced by a fresh one
        self._idle: list[Worker] = []
        self._count = 0
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start every process now (they load in the background), so that the first
        images do not wait for them."""
        with self._lock:
            while self._count < self.workers and not self._closed:
                self._idle.append(Worker(self.memory_allowance))
                self._count += 1

    def decode(self, data: bytes, spec: Preprocessing, deadline: float) -> np.ndarray:
        """The model's input for ``data`` (CHW float32), decoded in a worker process; a
        client error for a bad image. Blocks the calling thread; ``deadline`` is
        time.monotonic().

        The worker sends the 8-bit crop; it is normalised here (``app/imaging/pixels.py``)."""
        worker = self._ready_worker(deadline)
        try:
            patch = self._run(worker, data, spec, deadline)
        except _WorkerGone:
            log.warning("a decode worker died (exit code %s) while opening an image; "
                        "starting another", worker.process.exitcode)
            self._replace(worker)
            raise BadImage(_CRASHED) from None
        except _Stopped as stopped:
            self._replace(worker)
            raise stopped.error from None
        except (ApiError, DecoderFailed):  # the worker answered and waits for the next job
            self._give_back(worker)
            raise
        except BaseException:  # the conversation may be half-way: never reuse this one
            self._replace(worker)
            raise
        self._give_back(worker)
        return normalise(patch, spec)

    def _ready_worker(self, deadline: float) -> Worker:
        """An idle worker that has finished starting; a second try if one died starting or
        while idle (not the image's fault)."""
        for _ in range(2):
            worker = self._take()
            if worker.ready and worker.process.is_alive():
                return worker
            if worker.ready:  # it died while idle (killed from outside, out of memory)
                self._replace(worker)
                continue
            try:
                arrived, message = worker.receive(deadline - time.monotonic())
            except _WorkerGone:
                self._replace(worker)
                continue
            if not arrived:
                self._give_back(worker)  # still starting; the next image gets it
                raise too_busy_to_start()
            worker.ready = message == READY
            if worker.ready:
                return worker
            self._replace(worker)
        raise DecoderFailed("the image decoder processes cannot start; see the log")

    def _run(self, worker: Worker, data: bytes, spec: Preprocessing,
             deadline: float) -> bytes:
        used_before = worker.cpu_seconds()
        granted = min(PREGRANT_BYTES, self.limits.max_image_bytes)
        if not self.reservations.reserve(granted):
            granted = 0  # the budget is busy: this image asks for its own peak
        try:
            worker.send((data, self.limits.max_pixels, spec, granted))
            kind, value = self._answer(worker, used_before, deadline)
        finally:
            self.reservations.release(granted)
        if kind == "plan":
            peak = int(value)
            refusal = self._refusal(peak)
            worker.send(refusal is None)
            if refusal is not None:
                raise refusal
            try:
                kind, value = self._answer(worker, used_before, deadline)
            finally:
                self.reservations.release(peak)
        if kind == "done" and isinstance(value, bytes):
            return value
        if kind == "error" and isinstance(value, ApiError):
            raise value
        raise DecoderFailed(f"the image decoder failed: {value}")

    def _refusal(self, peak: int) -> ApiError | None:
        """Why an image with this predicted peak may not be decoded now (None: it may, and
        its peak is reserved)."""
        allowed = self.limits.max_image_bytes
        if peak > allowed:
            return ImageTooLarge(
                f"Opening this image would need about {peak / MIB:.0f} MiB of memory; one "
                f"image may use {allowed / MIB:.0f} MiB (the max_image_memory setting). "
                "Send a smaller image.")
        if peak > self.reservations.total:
            return ImageTooLarge(
                f"Opening this image would need about {peak / MIB:.0f} MiB of memory, more "
                f"than all images together may use ({self.reservations.total / MIB:.0f} MiB, the "
                "decode_memory_budget setting). Send a smaller image.")
        if not self.reservations.reserve(peak):
            return Overloaded("vramguard is busy opening other large images and has no "
                              "memory to spare for this one right now. Try again shortly.",
                              retry_after=1)
        return None

    def _answer(self, worker: Worker, used_before: float, deadline: float) -> tuple[str, Any]:
        """The worker's next message, waiting at most until its CPU time for this image
        passes the limit or the deadline passes (then it is stopped).

        The decoders are single-threaded, so a process cannot use more CPU time than the
        time that passes: waiting for the CPU time still left costs no wake-ups for an
        ordinary image and stops a runaway one within a few milliseconds of its limit."""
        while True:
            left = self.limits.cpu_s - (worker.cpu_seconds() - used_before)
            if left < 0:
                raise _Stopped(ImageTooComplex(
                    f"This image took more than {self.limits.cpu_s:g} s of computing time to "
                    "open, so vramguard stopped. The file may be damaged or built to slow "
                    "the service down. Open it in an image editor and save it again, or "
                    "send a smaller version."))
            if time.monotonic() >= deadline:
                raise _Stopped(too_busy_to_start())
            arrived, message = worker.receive(min(max(left, MIN_WAIT_S),
                                                  deadline - time.monotonic()))
            if arrived:
                kind, value = message
                return str(kind), value

    def _take(self) -> Worker:
        with self._lock:
            if self._closed:
                raise too_busy_to_start()
            if self._idle:
                return self._idle.pop()
            self._count += 1
            return Worker(self.memory_allowance)

    def _give_back(self, worker: Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.ask_to_stop()
        worker.end(kill=False)

    def _replace(self, worker: Worker) -> None:
        """Kill ``worker`` and start a fresh process in its place."""
        worker.end(kill=True)
        with self._lock:
            self.replaced += 1
            if self._closed:
                self._count -= 1
            else:
                self._idle.append(Worker(self.memory_allowance))

    def close(self) -> None:
        """Stop every idle process (a busy one stops when its job ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.ask_to_stop()
        for worker in idle:
            worker.end(kill=not worker.ready)
