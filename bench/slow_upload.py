"""A large image over a slow link, at the server's defaults: the whole-body deadline
lets it through, and trickles are cut within theirs.

    python -m bench.slow_upload [--mib 32] [--rate-mib 1.0]

One server on its defaults (``min_upload_bytes_per_s`` 1 MiB/s, ``upload_grace_s`` 5 s,
``request_timeout_s`` 10 s). A real client (one socket, 64 KiB writes paced to the
rate) uploads a PNG of ``--mib`` MiB of noise to ``/v1/classify`` at exactly
``--rate-mib`` MiB a second, the smallest rate the defaults allow; then the same upload
at half that rate, and a trickle of one byte every 5 s, both of which must be cut with
408 by their deadlines (grace + bytes so far / rate: for the half-rate upload at 10 s,
for the trickle at 5 s). Prints one JSON line per upload. 127.0.0.1 only; every upload
ends by itself.
"""

from __future__ import annotations

import argparse
import io
import json
import select
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.process import free_port, running, server_env

CHUNK = 64 * 1024


def noise_png(size: int) -> bytes:
    """A PNG of random pixels about ``size`` bytes long (noise does not compress)."""
    side = int((size / 3) ** 0.5)
    pixels = np.random.default_rng(26).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    return out.getvalue()


def upload(port: int, body: bytes, bytes_per_s: float, chunk: int = CHUNK) -> dict[str, object]:
    """POST ``body`` at ``bytes_per_s``; the status, the seconds, the bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                 b"Content-Type: image/png\r\nContent-Length: %d\r\nConnection: close\r\n"
                 b"\r\n" % (port, len(body)))
    started, sent = time.monotonic(), 0
    with sock:
        while sent < len(body):
            wait = max(0.0, started + sent / bytes_per_s - time.monotonic())
            if select.select([sock], [], [], wait)[0]:
                break  # answered before the end: cut (noticed at once, not at the next write)
            try:
                sock.sendall(body[sent:sent + chunk])
            except OSError:
                break
            sent = min(len(body), sent + chunk)
        answer = b""
        while not answer.endswith(b"}") and (part := sock.recv(65536)):
            answer += part
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    _, _, payload = answer.partition(b"\r\n\r\n")
    try:
        said = json.loads(payload).get("error", {}).get("message", "")
    except ValueError:
        said = payload[:120].decode("latin-1")
    return {"status": status, "said": said[:90], "seconds": round(time.monotonic() - started, 2),
            "sent_mib": round(sent / 1024**2, 2), "size_mib": round(len(body) / 1024**2, 2),
            "rate_mib_per_s": round(bytes_per_s / 1024**2, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=32.0)
    parser.add_argument("--rate-mib", type=float, default=1.0)
    args = parser.parse_args()
    body = noise_png(int(args.mib * 1024**2) - 64 * 1024)
    rate = args.rate_mib * 1024**2
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        log, config = Path(folder) / "server.log", Path(folder) / "config.toml"
        config.write_text("")  # the defaults, whatever this user's own config says
        env = server_env(VRAMGUARD_CONFIG=str(config),
                         VRAMGUARD_TOKEN_FILE=str(Path(folder) / "token"),
                         VRAMGUARD_LOG_DIR=folder, VRAMGUARD_CACHE="false")
        command = [sys.executable, "-m", "app", "serve", "--port", str(port)]
        with running(command, f"http://127.0.0.1:{port}/readyz", log, env=env):
            for name, speed, chunk in (("at the minimum rate", rate, CHUNK),
                                       ("at half the minimum rate", rate / 2, CHUNK),
                                       ("a trickle, 1 byte every 5 s", 0.2, 1)):
                print(json.dumps({"upload": name, **upload(port, body, speed, chunk)}),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
