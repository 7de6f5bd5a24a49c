"""`vramguard classify`: one record per image file (JSON lines, CSV, text), broken files
failed and reported, missing paths reported and skipped, files that are not sendable
(pipes, devices, huge, odd names), the exit status, Ctrl-C; against
the real app (stand-in engine) served by uvicorn in a thread. Starting a server for the
run: live/test_cli_classify_live.py."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from asgi import ReadyEngine, built_app, state_of
from photo_tree import noisy_jpeg, photo_tree

from app.cli.classify import ROUNDS
from app.cli.main import main
from app.errors import Loading, Overloaded
from bench.process import ROOT


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    return photo_tree(tmp_path)


@contextmanager
def serving(tmp_path: Path, engine: type[ReadyEngine] = ReadyEngine) -> Iterator[str]:
    """The real app with a stand-in engine, on a free port, until the block ends."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with built_app(tmp_path, ready=True, port=port) as app:
        state_of(app).engine = engine(state_of(app).settings)
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
        thread.start()
        try:
            while not server.started:
                time.sleep(0.01)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(10)
            listener.close()


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["classify", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_json_has_one_record_per_image_and_strict_sets_the_status(
        tmp_path: Path, tree: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tree["a"].parent)
    with serving(tmp_path) as url:
        status, out, err = run(capsys, folder, "-r", "--json", "--top-k", "2", "--url", url)
        strict, _, _ = run(capsys, folder, "-r", "--json", "--strict", "--url", url)
    records = {record["path"]: record for record in map(json.loads, out.splitlines())}
    assert set(records) == {str(path) for path in tree.values()}  # not notes.txt
    for name in ("a", "b", "c"):
        record = records[str(tree[name])]
        assert len(record["predictions"]) == 2 and record["model"] and "error" not in record
    for name in ("noise", "cut"):
        assert records[str(tree[name])]["error"]["code"] == "bad_image"
    assert status == 0 and strict == 1
    assert "3 tagged, 2 failed, 0 skipped" in err


def test_csv_has_a_header_and_a_row_per_image(
        tmp_path: Path, tree: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with serving(tmp_path) as url:
        status, out, _ = run(capsys, str(tree["a"].parent), "--csv", "--top-k", "3",
                             "--url", url)
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["path", "model", "label_1", "score_1", "label_2", "score_2",
                       "label_3", "score_3", "error"]
    by_path = {row[0]: row for row in rows[1:]}
    # Without --recursive the subfolder's images are left out (and the user told so).
    assert set(by_path) == {str(tree[name]) for name in ("a", "c", "noise")}
    assert by_path[str(tree["a"])][2] and float(by_path[str(tree["a"])][3]) > 0
    assert by_path[str(tree["noise"])][8].startswith("bad_image: ")
    assert status == 0


def test_a_missing_path_is_reported_and_skipped(
        tmp_path: Path, tree: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "gone.jpg"
    with serving(tmp_path) as url:
        status, out, err = run(capsys, str(tree["a"]), str(missing), "--url", url)
        strict, _, _ = run(capsys, str(tree["a"]), str(missing), "--strict", "--url", url)
    assert out.startswith(f"{tree['a']}: class-9 ")  # the stand-in's best class
    assert len(out.splitlines()) == 1
    assert f"skipped {missing}: no such file or folder" in err
    assert "1 tagged, 0 failed, 1 skipped" in err
    assert (status, strict) == (0, 1)


def test_usage_errors_exit_with_2(tmp_path: Path, tree: dict[str, Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--json", "--csv", "x"], ["--top-k", "0", "x"], []):
        with pytest.raises(SystemExit) as exited:
            main(["classify", *args])
        assert exited.value.code == 2
    with serving(tmp_path) as url:
        status, out, err = run(capsys, str(tree["a"]), "--model", "no-such-model",
                               "--url", url)
    assert status == 2 and not out
    assert "There is no model called 'no-such-model'" in err


class BusyAtFirst(ReadyEngine):
    """Says "overloaded" to its first two images."""

    refusals = 2

    async def classify(self, *args: Any, **kwargs: Any) -> Any:
        if self.refusals:
            self.refusals -= 1
            raise Overloaded("busy", retry_after=0.1)
        return await super().classify(*args, **kwargs)


def test_answers_worth_another_try_are_sent_again(
        tmp_path: Path, tree: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    images = [str(tree[name]) for name in ("a", "b", "c")]
    with serving(tmp_path, BusyAtFirst) as url:
        status, out, err = run(capsys, *images, "--json", "--strict", "--url", url)
    assert sorted(json.loads(line)["path"] for line in out.splitlines()) == sorted(images)
    assert all("predictions" in json.loads(line) for line in out.splitlines())
    assert status == 0 and "3 tagged, 0 failed" in err


class LoadingAtFirst(ReadyEngine):
    """Says "loading" to its first five requests: more than the rounds of retries."""

    refusals = 5

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        if self.refusals:
            self.refusals -= 1
            raise Loading("The model is being loaded; try again in 1 s.", retry_after=1)
        return await super().acquire(*args, **kwargs)


def test_a_model_being_loaded_is_waited_for_beyond_the_rounds(
        tmp_path: Path, tree: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert LoadingAtFirst.refusals > ROUNDS
    with serving(tmp_path, LoadingAtFirst) as url:
        status, out, err = run(capsys, str(tree["a"]), "--json", "--strict", "--url", url)
    assert status == 0 and "1 tagged, 0 failed" in err
    assert "predictions" in json.loads(out)


class SlowEngine(ReadyEngine):
    async def classify(self, *args: Any, **kwargs: Any) -> Any:
        import asyncio

        await asyncio.sleep(0.2)
        return await super().classify(*args, **kwargs)


def test_ctrl_c_stops_with_a_summary(tmp_path: Path) -> None:
    """Ctrl-C part way: status 130, a summary of what was done, and the server is left
    with nothing in progress."""
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(60):
        (folder / f"{i:02}.jpg").write_bytes(noisy_jpeg(i))
    with serving(tmp_path, SlowEngine) as url:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "classify", str(folder), "--json", "--url", url],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python")},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert process.stdout is not None
        first = process.stdout.readline()  # the first answer: it is under way
        process.send_signal(signal.SIGINT)
        # Read through the same buffered file: readline() may already hold later lines,
        # which communicate(), reading the pipe underneath, would never see.
        out = process.stdout.read()
        err = process.communicate(timeout=30)[1]
        stats = httpx.get(f"{url}/v1/stats").json()
    assert json.loads(first)["path"].startswith(str(folder))
    assert process.returncode == 130
    done = 1 + len(out.splitlines())
    assert re.search(rf"Stopped after {done} of 60 images: {done} tagged", err.decode()), err
    assert stats["queue_depth"] == 0 and stats["in_flight"] == 0


def classify_command(url: str, *args: str, env: dict[str, str] | None = None,
                     ) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own, bounded: the files here would hang or swell
    the one that reads them."""
    return subprocess.run(
        [sys.executable, "-m", "app", "classify", "--json", "--strict", "--url", url, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python"), **(env or {})})


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_pipe_or_a_device_is_skipped_saying_so_and_the_rest_are_tagged(
        tmp_path: Path) -> None:
    """A FIFO named like an image (in a folder and named itself) would hang the command,
    /dev/zero would read until memory ran out: each is skipped, with why."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(noisy_jpeg(1))
    os.mkfifo(folder / "pipe.jpg")
    with serving(tmp_path) as url:
        done = classify_command(url, str(folder), str(folder / "pipe.jpg"), "/dev/zero")
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["path"] for r in records] == [str(folder / "a.jpg")]
    assert f"skipped {folder / 'pipe.jpg'}: it is a pipe, not a file" in done.stderr
    assert "skipped /dev/zero: it is a device, not a file" in done.stderr
    assert "1 tagged, 0 failed, 2 skipped" in done.stderr
    assert done.returncode == 1  # --strict: files were skipped


def test_a_file_larger_than_the_server_takes_is_skipped_before_it_is_read(
        tmp_path: Path) -> None:
    """A sparse 1 GiB file named .jpg costs no disk; read whole, it cost 4 GB of memory."""
    big = tmp_path / "big.jpg"
    with big.open("wb") as out:
        out.truncate(1024**3)
    small = tmp_path / "small.jpg"
    small.write_bytes(noisy_jpeg(2))
    with serving(tmp_path) as url:
        command = subprocess.Popen(
            [sys.executable, "-m", "app", "classify", "--json", "--url", url, str(big),
             str(small)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "clients" / "python")})
        peak = 0
        watched = psutil.Process(command.pid)
        while command.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, watched.memory_info().rss)
            time.sleep(0.02)
        out, err = command.communicate(timeout=60)
    done = subprocess.CompletedProcess(command.args, command.returncode, out, err)
    assert f"skipped {big}: it is 1.0 GiB, more than the 32 MiB vramguard takes per " \
        "image (max_body_bytes)" in done.stderr, done.stderr
    assert [json.loads(line)["path"] for line in done.stdout.splitlines()] == [str(small)]
    assert peak < 300 * 1024**2, peak  # the command's own memory, far from the file's size


def test_a_file_name_that_is_not_utf8_is_sent_like_any_other(tmp_path: Path) -> None:
    """Such a name crashed the sender: every file of its stream failed after 10 s."""
    folder = tmp_path / "names"
    folder.mkdir()
    odd = folder / os.fsdecode(b"caf\xe9 \"1\".jpg")
    odd.write_bytes(noisy_jpeg(3))
    (folder / "plain.jpg").write_bytes(noisy_jpeg(4))
    with serving(tmp_path) as url:
        done = classify_command(url, str(folder))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(records) == 2 and all("predictions" in r for r in records), records
