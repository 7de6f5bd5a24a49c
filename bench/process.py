"""Start a server process, wait until its /readyz answers 200, stop it with SIGTERM."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


def server_env(**extra: str) -> dict[str, str]:
    """This environment without the caller's own VRAMGUARD_ settings, plus ``extra``: a
    benchmarked server runs on its defaults and the options it is given."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    return {**inherited, **extra}


def process_tree(pid: int) -> list[psutil.Process]:
    """A server and every process it started (decode workers): what it costs in total."""
    process = psutil.Process(pid)
    return [process, *process.children(recursive=True)]


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a server and its decode workers have used so far."""
    return sum(m.cpu_times().user + m.cpu_times().system for m in process_tree(pid))


def own_cpu_seconds() -> float:
    """CPU time this process (a load generator, every thread) has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running(command: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None,
            ready_timeout: float = 180, cwd: Path = ROOT,
            preexec_fn: Callable[[], object] | None = None,
            ) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` in ``cwd`` until the block ends; raise with its log if it never gets
    ready. ``preexec_fn`` runs in the child before it starts (e.g. to lower its limits)."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"exited with {process.returncode}:\n"
                                   f"{log.read_text(errors='replace')}")
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {ready_timeout} s:\n"
                                   f"{log.read_text(errors='replace')}")
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
