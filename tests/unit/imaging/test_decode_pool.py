"""The decode worker processes: they give the same pixels as decoding in this process, and a
worker that runs past its CPU limit or the deadline, crashes, or runs out of memory is
replaced while the caller gets a clear error. Every wait here is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from images import encode, photo, scan_bomb
from PIL import Image

from app.errors import BadImage, DeadlineExceeded, ImageTooComplex, ImageTooLarge, Overloaded
from app.imaging.decode_pool import (
    DecodeLimits,
    DecodePool,
    DecodeReservations,
    DecoderFailed,
    Worker,
)
from app.imaging.decode_worker import READY, TRIM_AFTER_BYTES
from app.imaging.decoding import open_image
from app.imaging.pixels import model_input
from app.models.efficientnet_lite import PREPROCESSING

MIB = 1024**2
LIMITS = DecodeLimits(max_pixels=40_000_000, max_image_bytes=300 * MIB, cpu_s=1.0,
                      max_body_bytes=32 * MIB)
BOUND = 10.0  # seconds: the longest any single wait here may take
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def slow_jpeg() -> bytes:
    """A JPEG that passes the structural checks but takes about 0.1 s of CPU to decode
    (160 scans of 8 megapixels)."""
    return scan_bomb(4000, 2000, 150)


@contextmanager
def decode_pool(limits: DecodeLimits = LIMITS, budget: int = 1024 * MIB,
                workers: int = 1) -> Iterator[DecodePool]:
    pool = DecodePool(workers, limits, budget)
    try:
        yield pool
    finally:
        pool.close()


def deadline(seconds: float = BOUND) -> float:
    return time.monotonic() + seconds


def the_worker(pool: DecodePool) -> Worker:
    """The pool's only (idle, started) worker."""
    pool.start()
    (worker,) = pool._idle
    return worker


def test_the_pool_gives_the_same_pixels_as_decoding_here() -> None:
    with decode_pool() as pool:
        pixels = pool.decode(photo(), PREPROCESSING, deadline())
        again = pool.decode(photo(), PREPROCESSING, deadline())
    here = model_input(open_image(photo(), LIMITS.max_pixels, PREPROCESSING.resize),
                       PREPROCESSING)
    assert pixels.dtype == np.float32 and pixels.shape == (3, 224, 224)
    assert np.array_equal(pixels, here) and np.array_equal(again, here)
    assert pool.replaced == 0 and pool.reservations.used == 0


def test_a_bad_image_is_a_client_error_and_the_worker_stays() -> None:
    with decode_pool() as pool:
        worker = the_worker(pool)
        with pytest.raises(BadImage, match="damaged"):
            pool.decode(photo()[:2000], PREPROCESSING, deadline())
        assert pool.decode(photo(), PREPROCESSING, deadline()).shape == (3, 224, 224)
        assert pool._idle == [worker] and pool.replaced == 0


def test_a_decoder_bug_is_a_server_error_and_the_worker_stays() -> None:
    """Anything but a client error from the worker (here: text where bytes belong) is
    DecoderFailed, which the route answers with 500 and logs."""
    with decode_pool() as pool:
        worker = the_worker(pool)
        with pytest.raises(DecoderFailed, match="TypeError"):
            pool.decode("not bytes", PREPROCESSING, deadline())  # type: ignore[arg-type]
        assert pool.decode(photo(), PREPROCESSING, deadline()).shape == (3, 224, 224)
        assert pool._idle == [worker] and pool.replaced == 0


def test_a_decode_past_its_cpu_limit_is_stopped_and_the_worker_replaced() -> None:
    with decode_pool(replace(LIMITS, cpu_s=0.03)) as pool:
        worker = the_worker(pool)
        with pytest.raises(ImageTooComplex, match="computing time") as stopped:
            pool.decode(slow_jpeg(), PREPROCESSING, deadline())
        assert stopped.value.status == 422
        assert not worker.process.is_alive() and pool.replaced == 1
        assert pool.reservations.used == 0  # its reservation was given back
        assert pool.decode(photo(), PREPROCESSING, deadline()).shape == (3, 224, 224)


def test_a_decode_is_stopped_at_the_request_deadline() -> None:
    with decode_pool() as pool:
        worker = the_worker(pool)
        pool.decode(photo(), PREPROCESSING, deadline())  # started and ready
        with pytest.raises(DeadlineExceeded):
            pool.decode(slow_jpeg(), PREPROCESSING, time.monotonic() + 0.02)
        assert not worker.process.is_alive() and pool.replaced == 1


@LINUX
def test_a_worker_that_crashes_mid_image_is_a_clear_error_and_is_replaced() -> None:
    with decode_pool() as pool:
        worker = the_worker(pool)
        pool.decode(photo(), PREPROCESSING, deadline())
        before, started = worker.cpu_seconds(), time.monotonic()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                pool.decode(slow_jpeg(), PREPROCESSING, deadline())
            except BadImage as error:
                outcome["error"] = error

        thread = threading.Thread(target=run)
        thread.start()
        while worker.cpu_seconds() < before + 0.02:  # it is decoding now
            assert time.monotonic() < started + BOUND
            time.sleep(0.002)
        assert worker.process.pid is not None
        os.kill(worker.process.pid, signal.SIGSEGV)
        thread.join(BOUND)
        assert "crashed" in outcome["error"].message
        assert worker.process.exitcode == -signal.SIGSEGV and pool.replaced == 1
        assert pool.decode(photo(), PREPROCESSING, deadline()).shape == (3, 224, 224)


def test_a_worker_that_died_while_idle_costs_the_next_image_nothing() -> None:
    with decode_pool() as pool:
        worker = the_worker(pool)
        pool.decode(photo(), PREPROCESSING, deadline())
        worker.process.kill()
        worker.process.join(BOUND)
        assert pool.decode(photo(), PREPROCESSING, deadline()).shape == (3, 224, 224)
        assert pool.replaced == 1


@LINUX
def test_a_worker_cannot_grow_past_its_memory_allowance() -> None:
    """Even told to go ahead with an image bigger than its allowance, the worker answers
    with a clean error instead of taking the memory."""
    worker = Worker(memory_allowance=16 * MIB)
    try:
        assert worker.receive(BOUND) == (True, READY)
        big = encode(Image.new("RGB", (3000, 3000), (9, 9, 9)), "PNG")  # 36 MB decoded
        worker.send((big, LIMITS.max_pixels, PREPROCESSING, 0))  # nothing granted
        _, (kind, peak) = worker.receive(BOUND)
        assert kind == "plan" and peak > 36 * MIB
        worker.send(True)  # go ahead anyway
        _, (kind, error) = worker.receive(BOUND)
        assert kind == "error" and isinstance(error, ImageTooLarge)
        assert "memory" in error.message
        worker.send((photo(), LIMITS.max_pixels, PREPROCESSING, 0))  # and it still works
        assert worker.receive(BOUND)[1][0] == "plan"
        worker.send(True)
        assert worker.receive(BOUND)[1][0] == "done"
        # A photo within what is granted up front goes straight to its answer.
        worker.send((photo(), LIMITS.max_pixels, PREPROCESSING, 32 * MIB))
        assert worker.receive(BOUND)[1][0] == "done"
    finally:
        worker.ask_to_stop()
        worker.end(kill=False)
    assert worker.process.exitcode == 0


@LINUX
def test_a_worker_gives_back_what_large_images_took() -> None:
    """Once a large image has been freed, glibc serves the next ones from its heap and
    keeps what they free: without a trim, a worker stayed 28 MiB larger for good after a
    36 MB bitmap and then an 8 MiB PNG."""
    flat = encode(Image.new("RGB", (3000, 3000), (9, 9, 9)), "PNG")  # 36 MB decoded
    noise = np.random.default_rng(0).integers(0, 256, (1500, 2000, 3), dtype=np.uint8)
    noisy = encode(Image.fromarray(noise), "PNG")  # 8 MiB
    for image in (flat, noisy):
        opened = open_image(image, LIMITS.max_pixels, PREPROCESSING.resize)
        assert len(image) + opened.peak_bytes > TRIM_AFTER_BYTES
    with decode_pool() as pool:
        worker = psutil.Process(the_worker(pool).process.pid)
        pool.decode(photo(), PREPROCESSING, deadline())
        before = worker.memory_info().rss
        for image in (flat, noisy, photo()):
            pool.decode(image, PREPROCESSING, deadline())
        assert worker.memory_info().rss - before < 8 * MIB


def test_an_image_predicted_over_the_limit_is_refused_before_decoding() -> None:
    small = DecodeLimits(max_pixels=40_000_000, max_image_bytes=30 * MIB, cpu_s=1.0,
                         max_body_bytes=MIB)
    with decode_pool(small) as pool:
        with pytest.raises(ImageTooLarge, match="max_image_memory"):
            pool.decode(slow_jpeg(), PREPROCESSING, deadline())  # predicted 41 MiB
        assert pool.replaced == 0 and pool.reservations.used == 0


def test_images_that_do_not_fit_the_budget_are_refused_at_once() -> None:
    with decode_pool(budget=100 * MIB) as pool:
        assert pool.reservations.reserve(70 * MIB)  # other large images in flight
        with pytest.raises(Overloaded) as busy:
            pool.decode(slow_jpeg(), PREPROCESSING, deadline())  # needs 41 MiB
        assert busy.value.status == 503 and busy.value.retry_after == 1
        assert pool.decode(photo(), PREPROCESSING, deadline()).shape == (3, 224, 224)
        pool.reservations.release(70 * MIB)
        pool.decode(slow_jpeg(), PREPROCESSING, deadline())
        assert pool.reservations.used == 0
    with decode_pool(budget=30 * MIB) as pool, pytest.raises(ImageTooLarge,
                                                             match="decode_memory_budget"):
        pool.decode(slow_jpeg(), PREPROCESSING, deadline())


def test_the_budget_counts_what_is_reserved() -> None:
    budget = DecodeReservations(100)
    assert budget.reserve(60) and not budget.reserve(41) and budget.reserve(40)
    budget.release(60)
    assert budget.used == 40


def test_close_ends_every_worker() -> None:
    """A worker that is ready is asked to stop and exits cleanly; one still starting is
    killed (it would take as long to start as to stop)."""
    with decode_pool(workers=2) as pool:
        pool.decode(photo(), PREPROCESSING, deadline())  # starts one, lazily
        pool.start()  # and the other
        ready, starting = pool._idle
    assert ready.ready and ready.process.exitcode == 0
    assert not starting.ready and not starting.process.is_alive()


def test_the_worker_module_loads_neither_torch_nor_numpy() -> None:
    """A worker imports app.imaging.decode_worker; torch would cost each start 1.3 s of CPU and
    660 MiB, numpy 110 ms and 18 MiB."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, app.imaging.decode_worker; print(sorted(m for m in "
         "('torch', 'numpy', 'starlette', 'fastapi') if m in sys.modules))"],
        capture_output=True, text=True, check=True, timeout=60,
        cwd=Path(__file__).resolve().parents[3])
    assert loaded.stdout.strip() == "[]"


@LINUX
def test_a_busy_worker_dies_with_the_server() -> None:
    """Killed, the server cannot stop its workers. An idle one sees its pipe close; a busy
    one (here: stopped, so it never reads the pipe) must be killed with the server, or it
    would run on for as long as its crafted image takes."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import time\n"
         "from app.imaging.decode_pool import Worker\n"
         "worker = Worker(None)\n"
         "worker.receive(60)\n"
         "print(worker.process.pid, flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[3])
    worker = None
    try:
        assert server.stdout is not None
        worker = psutil.Process(int(server.stdout.readline()))
        worker.suspend()
        server.kill()
        server.wait(BOUND)
        started = time.monotonic()
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < started + BOUND, "the worker outlived the server"
            time.sleep(0.01)
    finally:
        server.kill()
        if worker is not None and worker.is_running():
            worker.kill()
