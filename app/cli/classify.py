"""`vramguard classify PATH...`: tag image files and folders through the appliance.

It finds the running appliance the way every client does (``vramguard_client``'s
discovery) and, when none answers, starts one for the run and stops it at the end. The
images go in ``POST /v1/classify/stream`` requests (up to ``STREAM_FILES`` files or
``STREAM_BYTES`` each) rather than ``Client.classify_many``'s one request per image at a
fixed concurrency: the server reads each file only when it has room for it, so nothing
needs tuning here and nothing is refused for a full queue; one ``--embed`` forward pass
gives both answers; and an image costs less CPU in the server's event loop and here
(docs/benchmarks.md; its wall-clock gain on the loaded 2-core test machine was not
consistent). The stream is sent and read at once over one HTTP/1.1 connection (h11):
httpx, like most clients, reads an answer only after sending the whole body, which would
show no result before the last file is uploaded.

Results go to stdout as they arrive (a line, a JSON object or a CSV row per image), a
progress bar to stderr. Answers the server says are worth another try (busy, rate
limited, still starting) are sent again in a later stream, after the wait it asked for; a
model still being loaded (``loading``) is waited for, up to ``LOADING_WAIT_S``, without
using up those tries. An answer that is not vramguard's (another program on the port)
ends the run, saying what answered.
Files that cannot be read are reported on stderr and skipped; Ctrl-C stops at once
(the server withdraws what it had queued) and prints what was done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import h11
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from vramguard_client import (
    Client,
    DeadlineExceeded,
    InsufficientMemory,
    Loading,
    NotReady,
    Overloaded,
    RateLimited,
    VramguardError,
    find_server,
)

from app import __version__
from app.cli.classify_output import ImagesPerSecond, Output, Tally
from app.cli.image_files import not_regular, open_image_file, part_name
from app.cli.temporary_server import StartFailed, TemporaryServer, answers
from app.config import ConfigError, Settings, load_settings

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif",
                            ".tiff", ".jfif"})
RETRIED = frozenset(c.code for c in (RateLimited, Overloaded, DeadlineExceeded, NotReady,
                                     Loading, InsufficientMemory)) | {"connection_lost"}
"""What the client package retries; here the images are sent again in a later stream."""
ROUNDS = 4  # the first stream and three more for the images worth another try
LOADING_WAIT_S = 300.0  # how long a model being loaded is waited for (a large model, a
# busy computer), its refusals not counted as rounds
STREAM_TYPES = (b"application/x-ndjson", b"text/event-stream")
TITLE = re.compile(rb"<title[^>]*>([^<]{1,120})", re.IGNORECASE)
STREAM_FILES = 1000  # files per stream request (and below, bytes): well under the
STREAM_BYTES = 512 * 1024**2  # server's max_stream_bytes (2 GiB by default)
CLIENT_ID = "vramguard-classify"  # its own rate bucket: other local apps keep theirs
INTERRUPTED = 130  # the shell's status for a program ended by Ctrl-C


def find_images(names: Sequence[str], recursive: bool,
                warn: Callable[[str], None]) -> tuple[list[Path], int]:
    """The files to tag: those named, and the images in the folders named (their
    subfolders' too with ``recursive``); how many names were skipped (reported)."""
    found: list[Path] = []
    skipped = 0
    for name in names:
        path = Path(name)
        if path.is_dir():
            try:
                entries = list(path.rglob("*") if recursive else path.iterdir())
            except OSError as exc:
                warn(f"skipped {path}: {exc.strerror or exc}.")
                skipped += 1
                continue
            found += sorted(p for p in entries if p.suffix.lower() in IMAGE_SUFFIXES
                            and p.is_file())  # a regular file (or a link to one) only
            if not recursive and any(p.is_dir() for p in entries):
                warn(f"{path} has subfolders; add --recursive to tag their images too.")
        elif path.exists():
            why = not_regular(path)
            if why is None:
                found.append(path)
            else:
                warn(f"skipped {path}: {why}.")
                skipped += 1
        else:
            warn(f"skipped {path}: no such file or folder.")
            skipped += 1
    return found, skipped


def upload_limit() -> int:
    """The most a server takes per image: its ``max_body_bytes``, as this user's settings
    say (the server they start reads the same), else the default."""
    try:
        return int(load_settings().max_body_bytes)
    except ConfigError:
        return int(Settings.model_fields["max_body_bytes"].default)


def batches(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """The files in streams of at most STREAM_FILES files and about STREAM_BYTES."""
    batch: list[Path] = []
    size = 0
    for path in paths:
        with contextlib.suppress(OSError):  # unreadable: reported when it is sent
            size += path.stat().st_size
        batch.append(path)
        if len(batch) >= STREAM_FILES or size >= STREAM_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Fatal(Exception):
    """Nothing more can be tagged (no server, an unknown model): the message says why."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Round:
    """What one stream left to do: the images to send again, and how long to wait."""

    again: list[Path] = field(default_factory=list)
    wait_s: float = 0.0
    codes: set[str] = field(default_factory=set)  # why they are sent again

    def retry(self, paths: Sequence[Path], wait_s: float | None, code: str) -> None:
        self.again += paths
        self.wait_s = max(self.wait_s, wait_s or 1.0)
        self.codes.add(code)

    @property
    def loading(self) -> bool:
        """Whether every image to send again waits for its model's load only."""
        return self.codes == {Loading.code}


class Streamer:
    """Sends files as one image stream and reads its answer while it sends."""

    def __init__(self, url: str, query: dict[str, Any], on_result: Callable[[Path, dict[str,
                 Any]], None], on_failure: Callable[[Path, dict[str, Any]], None],
                 on_skip: Callable[[Path, OSError], None], limit: int) -> None:
        self.url = urlsplit(url)
        self.limit = limit  # the most bytes sent for one file
        self.target = "/v1/classify/stream?" + urlencode(query)
        self.on_result, self.on_failure, self.on_skip = on_result, on_failure, on_skip

    async def send(self, paths: Sequence[Path], last_try: bool) -> Round:
        """One stream of ``paths``: each answer reported as it comes (unless worth another
        try and this is not the ``last_try``), the rest left for the next round."""
        outcome = Round()
        try:
            reader, writer = await asyncio.open_connection(self.url.hostname, self.url.port)
        except OSError as exc:
            raise Fatal(f"cannot reach vramguard at {self.url.geturl()}: {exc}") from None
        conn = h11.Connection(h11.CLIENT)
        sent: list[Path] = []
        reached = [0]  # paths looked at by the sender (sent or skipped)
        boundary = secrets.token_hex(16)
        writer.write(conn.send(h11.Request(method="POST", target=self.target, headers=[
            ("Host", self.url.netloc), ("User-Agent", f"vramguard-classify/{__version__}"),
            ("X-Client-Id", CLIENT_ID), ("Accept", "application/x-ndjson"),
            ("Content-Type", f"multipart/form-data; boundary={boundary}"),
            ("Transfer-Encoding", "chunked")])) or b"")
        sender = asyncio.ensure_future(self._parts(conn, writer, boundary, paths, sent,
                                                   reached))
        answered: set[int] = set()
        stream_error: dict[str, Any] | None = None
        try:
            async for line in self._lines(conn, reader):
                if "index" in line:
                    index = int(line["index"])
                    answered.add(index)
                    self._answer(sent[index], line, outcome, last_try)
                elif "error" in line:
                    stream_error = line["error"]
        except (OSError, h11.ProtocolError) as exc:
            stream_error = {"code": "connection_lost", "message": f"the connection broke: {exc}"}
        except ValueError as exc:  # not JSON lines: not vramguard's answer
            stream_error = {"code": "unexpected_response", "message": str(exc)}
        except Fatal:
            if sent or reached[0] < len(paths):
                raise
            # Every file was skipped, so the stream held no image and was refused as such.
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        left = [p for i, p in enumerate(sent) if i not in answered] + list(paths[reached[0]:])
        if left:
            error = stream_error or {"code": "connection_lost",
                                     "message": "the stream ended before these images"}
            for path in left:
                self._answer(path, {"error": error}, outcome, last_try)
        return outcome

    def _answer(self, path: Path, line: dict[str, Any], outcome: Round, last_try: bool) -> None:
        if "result" in line:
            self.on_result(path, line["result"])
        elif line["error"]["code"] in RETRIED and not last_try:
            outcome.retry([path], line["error"].get("retry_after"), line["error"]["code"])
        else:
            self.on_failure(path, line["error"])

    async def _parts(self, conn: h11.Connection, writer: asyncio.StreamWriter, boundary: str,
                     paths: Sequence[Path], sent: list[Path], reached: list[int]) -> None:
        """Write each file as a part, read in chunks as it is sent (the server's pace
        decides when: ``drain`` waits while it has no room); one that cannot be sent is
        that file's own problem (``app.cli.image_files``)."""
        for path in paths:
            try:
                image = await asyncio.to_thread(open_image_file, path, self.limit)
            except OSError as exc:
                self.on_skip(path, exc)
                reached[0] += 1
                continue
            try:
                head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                        f"filename=\"{part_name(path)}\"\r\n"
                        "Content-Type: application/octet-stream\r\n\r\n")
                sent.append(path)
                reached[0] += 1
                writer.write(conn.send(h11.Data(data=head.encode())) or b"")
                chunks = image.chunks()
                # A read that fails part-way ends the part short: the server answers that
                # file as a broken image, and the stream goes on.
                with contextlib.suppress(OSError):
                    while data := await asyncio.to_thread(next, chunks, b""):
                        writer.write(conn.send(h11.Data(data=data)) or b"")
                        await writer.drain()
                writer.write(conn.send(h11.Data(data=b"\r\n")) or b"")
                await writer.drain()
            finally:
                image.close()
        writer.write(conn.send(h11.Data(data=f"--{boundary}--\r\n".encode())) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()

    async def _lines(self, conn: h11.Connection, reader: asyncio.StreamReader,
                     ) -> AsyncIterator[dict[str, Any]]:
        """The answer's JSON lines; for an answer that is not a stream, Fatal, or an error
        line that has its images sent again."""
        status, pending, body = 0, b"", b""
        headers: dict[bytes, bytes] = {}
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, dict(event.headers)
                if status == 200 and not headers.get(b"content-type", b"").startswith(
                        STREAM_TYPES):
                    status = -status  # read as the error answer it is
            elif isinstance(event, h11.Data) and status == 200:
                pending += event.data
                *complete, pending = pending.split(b"\n")
                for text in complete:
                    if text.strip():
                        yield json.loads(text)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if status != 200:
            error = self._error(abs(status), headers, body)
            if error.get("code") not in RETRIED:
                raise Fatal(f"vramguard refused the images: {error.get('message')}",
                            status=2 if status in (400, 404) else 1)
            yield {"error": {**error, "retry_after": float(headers.get(b"retry-after") or 1)}}

    def _error(self, status: int, headers: dict[bytes, bytes], body: bytes) -> dict[str, Any]:
        """vramguard's error (``{"error": {"code", "message"}}``); Fatal, saying what
        answered, for any other answer."""
        try:
            error = json.loads(body)["error"]
            if isinstance(error, dict) and isinstance(error.get("code"), str):
                return error
        except (ValueError, KeyError, TypeError):
            pass
        kind = headers.get(b"content-type", b"").split(b";")[0].decode("latin-1").strip()
        title = TITLE.search(body)
        what = (f"a web page titled \"{title.group(1).decode('utf-8', 'replace').strip()}\""
                if title else "a web page" if kind == "text/html"
                else f"a {kind} answer" if kind else "an answer")
        server = headers.get(b"server", b"").decode("latin-1")[:60]
        raise Fatal(f"the program answering at {self.url.geturl()} is not vramguard: it "
                    f"answered HTTP {status} with {what}"
                    f"{f' (it calls itself {server!r})' if server else ''}. Check the "
                    "address given with --url (vramguard's is printed when it starts, "
                    "default http://127.0.0.1:8765).")


def proven(found: str) -> str:
    """The vramguard found running, once it has proved it is this user's (the identity
    challenge, as the tray does): images never go to another program that holds its
    port. Fatal when it cannot prove it; ``--url`` skips the check."""
    with Client(timeout=30) as client:
        try:
            return client.verify()
        except VramguardError as exc:
            raise Fatal(f"{exc} To send them there anyway, add --url {found}") from None


def run_classify(args: argparse.Namespace) -> int:
    """The command: the status it exits with (see ``app.cli``)."""
    console = Console(stderr=True, highlight=False)

    def warn(text: str) -> None:
        console.print(f"vramguard classify: {text}", markup=False, soft_wrap=True)

    paths, missing = find_images(args.paths, args.recursive, warn)
    tally = Tally(total=len(paths) + missing, skipped=missing)
    server: TemporaryServer | None = None
    status = 0
    progress = Progress(TextColumn("tagging"), BarColumn(), MofNCompleteColumn(),
                        ImagesPerSecond(), TimeRemainingColumn(),
                        TextColumn("{task.fields[failed]} failed"), console=console,
                        redirect_stdout=False, redirect_stderr=False,
                        disable=not console.is_terminal)
    try:
        url = args.url or find_server().url
        if not paths:
            warn("no images to tag.")
        elif not args.url and not answers(url):
            warn("no vramguard is running; starting one for this run (it stops at the end; "
                 "a first start can take a minute).")
            server = TemporaryServer(args.model)
            try:
                server.wait_ready()
            except StartFailed as exc:
                raise Fatal(str(exc)) from None
            url = server.url
            warn(f"started at {url}.")
        elif paths and not args.url:
            url = proven(url)
        if paths:
            tally.started = time.monotonic()  # images/s: not counting a server's start
            with progress:
                asyncio.run(_tag(args, url, paths, tally, progress, console, warn))
    except KeyboardInterrupt:
        console.print(tally.summary(stopped=True), markup=False, soft_wrap=True)
        return INTERRUPTED
    except Fatal as exc:
        warn(str(exc))
        status = exc.status
    finally:
        if server is not None:
            server.stop()
    if status:
        return status
    console.print(tally.summary(stopped=False), markup=False, soft_wrap=True)
    return 1 if args.strict and (tally.failed or tally.skipped) else 0


async def _tag(args: argparse.Namespace, url: str, paths: list[Path], tally: Tally,
               progress: Progress, console: Console, warn: Callable[[str], None]) -> None:
    """Every image through streams, answers out as they come, retries in later rounds."""
    task = progress.add_task("tagging", total=tally.total, completed=tally.skipped, failed=0)
    to_terminal = sys.stdout.isatty() and console.is_terminal and not progress.disable

    def write(text: str) -> None:
        if to_terminal:  # above the bar (it shares the terminal)
            progress.console.print(text, markup=False, soft_wrap=True)
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    output = Output("json" if args.json else "csv" if args.csv else "text", args.top_k,
                    args.embed, write)

    # Written, then counted: a Ctrl-C between the two must not count an image whose
    # result never reached the output.
    def result(path: Path, answer: dict[str, Any]) -> None:
        output.result(path, answer)
        tally.ok += 1
        progress.advance(task)

    def failure(path: Path, error: dict[str, Any]) -> None:
        output.failure(path, error)
        tally.failed += 1
        progress.update(task, advance=1, failed=tally.failed)

    def skip(path: Path, exc: OSError) -> None:
        tally.skipped += 1
        warn(f"skipped {path}: {exc.strerror or exc}.")
        progress.advance(task)

    query = {"top_k": args.top_k, **({"model": args.model} if args.model else {}),
             **({"embed": "true"} if args.embed else {})}
    streamer = Streamer(url, query, result, failure, skip, upload_limit())
    for batch in batches(paths):
        todo, rounds = batch, 0
        load_by = time.monotonic() + LOADING_WAIT_S
        while True:
            outcome = await streamer.send(todo, last_try=rounds == ROUNDS - 1)
            if not outcome.again:
                break
            todo = outcome.again
            if not (outcome.loading and time.monotonic() + outcome.wait_s < load_by):
                rounds += 1
            await asyncio.sleep(min(outcome.wait_s, 30.0))
