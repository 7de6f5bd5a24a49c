"""Smoke-test a built bundle the way a user meets it: start, classify, doctor, stop.

    python -m packaging.smoke --bundle dist/vramguard [--json report.json]
    python -m packaging.smoke --venv            # the same checks on `python -m app`

Starts `vramguard serve` on a free loopback port with its settings, token, cache and
logs in a temporary folder (the user's own are never touched), waits for /readyz,
classifies a photo of an espresso, checks that a second launch announces the running
one instead of failing, runs `vramguard doctor`, and stops the server with
`vramguard stop`, which must end it with exit status 0. Reports the time to ready and
the peak memory (RSS) of the server process. Exit status 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
PHOTO = ROOT / "tests" / "data" / "coffee.jpg"
EXPECTED_LABEL = "espresso"


class SmokeFailure(Exception):
    """A step failed; the message says which and shows what the program printed."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PeakRss:
    """Samples a process's resident memory every 50 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def isolated_env(folder: Path) -> dict[str, str]:
    """Settings that keep the smoke test's files out of the user's own folders."""
    env = dict(os.environ)
    (folder / "config.toml").write_text("# defaults: the smoke test changes nothing\n")
    env.update(VRAMGUARD_CONFIG=str(folder / "config.toml"),
               VRAMGUARD_TOKEN_FILE=str(folder / "admin-token"),
               VRAMGUARD_CACHE_DIR=str(folder / "cache"),
               VRAMGUARD_LOG_DIR=str(folder / "logs"),
               VRAMGUARD_MAX_BATCH_SIZE="8")
    return env


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SmokeFailure(f"the server exited with status {process.returncode} before "
                               f"it was ready:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SmokeFailure(f"not ready after {timeout:.0f} s:\n{log.read_text(errors='replace')}")


def run_step(command: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SmokeFailure(f"{' '.join(command[-2:])} exited with {done.returncode}:\n{output}")
    return output


def smoke(command: list[str], ready_timeout: float) -> dict[str, object]:
    """All the steps against one way of launching vramguard; returns the measurements."""
    with tempfile.TemporaryDirectory(prefix="vramguard-smoke-") as temporary:
        folder = Path(temporary)
        env = isolated_env(folder)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = folder / "server.log"
        started = time.monotonic()
        with log.open("wb") as sink:
            server = subprocess.Popen([*command, "serve", "--port", str(port)], env=env,
                                      stdout=sink, stderr=subprocess.STDOUT)
        rss = PeakRss(server.pid)
        try:
            wait_ready(url, server, ready_timeout, log)
            ready_s = time.monotonic() - started
            answer = httpx.post(f"{url}/v1/classify", content=PHOTO.read_bytes(),
                                headers={"Content-Type": "image/jpeg"}, timeout=30)
            if answer.status_code != 200:
                raise SmokeFailure(f"classify answered {answer.status_code}: {answer.text}")
            label = answer.json()["predictions"][0]["label"]
            if label != EXPECTED_LABEL:
                raise SmokeFailure(f"classify said {label!r}, expected {EXPECTED_LABEL!r}")
            again = run_step([*command, "serve", "--port", str(port)], env, 60)
            if "already running" not in again:
                raise SmokeFailure(f"a second launch did not find the first:\n{again}")
            doctor_started = time.monotonic()
            doctor = run_step([*command, "doctor"], env, 300)
            doctor_s = time.monotonic() - doctor_started
            if "CUDA libraries" not in doctor or "all checks passed" not in doctor:
                raise SmokeFailure(f"doctor did not pass:\n{doctor}")
            run_step([*command, "stop", "--port", str(port)], env, 60)
            code = server.wait(30)
            if code != 0:
                raise SmokeFailure(f"the server ended with status {code} after "
                                   f"'vramguard stop':\n{log.read_text(errors='replace')}")
        finally:
            peak = rss.stop()
            if server.poll() is None:
                server.kill()
                server.wait()
    return {"command": " ".join(command), "time_to_ready_s": round(ready_s, 2),
            "peak_rss_bytes": peak, "label": label, "doctor_s": round(doctor_s, 2),
            "doctor": doctor.splitlines()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--bundle", type=Path, help="the bundle folder (dist/vramguard)")
    target.add_argument("--venv", action="store_true", help="run `python -m app` instead")
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args(argv)
    if args.venv:
        command = [sys.executable, "-m", "app"]
    else:
        executable = args.bundle / ("vramguard.exe" if sys.platform == "win32" else "vramguard")
        if not executable.is_file():
            print(f"smoke: no bundle at {executable}", file=sys.stderr)
            return 1
        command = [str(executable.resolve())]
    try:
        result = smoke(command, args.ready_timeout)
    except (SmokeFailure, subprocess.TimeoutExpired) as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"smoke: passed - ready in {result['time_to_ready_s']} s, peak RSS "
          f"{result['peak_rss_bytes'] / 1024**2:.0f} MiB, top label {result['label']!r}, "
          f"doctor {result['doctor_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
