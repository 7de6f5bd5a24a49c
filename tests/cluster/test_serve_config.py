"""The shipped Serve config as a user runs it (issue 24): ``serve run
deploy/ray/serve.yaml`` with only its ports and Redis URL changed, its placement
untouched. On this machine (no GPU) it serves on the CPU; on a Ray that reports a GPU
(declared with ``ray start --num-gpus 1``: a stand-in, this machine has no GPU) each
replica takes one; replicas no node can hold fail the deploy with a message."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from images import photo
from live_server import ROOT, free_port

yaml = pytest.importorskip("yaml")
pytest.importorskip("redis", reason="the cluster extra is not installed")
with warnings.catch_warnings():  # ray's pydantic fields use a deprecated style
    warnings.simplefilter("ignore", DeprecationWarning)
    ray = pytest.importorskip("ray", reason="the cluster extra is not installed")
    from ray import serve
from redis_fixture import RedisServer  # noqa: E402

SHIPPED = ROOT / "deploy" / "ray" / "serve.yaml"
SERVE = Path(sys.executable).parent / "serve"
RAY = Path(sys.executable).parent / "ray"
APP = "vramguard"
READY_TIMEOUT_S = 300  # Ray's start and a warmup on 2 busy cores
PLACED_TIMEOUT_S = 180
JPEG = {"Content-Type": "image/jpeg"}


def config_for(redis_url: str, **changes: Any) -> dict[str, Any]:
    """The shipped config with this machine's ports and Redis: only ``http_options.port``,
    ``args.port``, ``args.replica_port`` and ``args.redis_url`` change. ``changes`` go
    into the deployment's section."""
    config = yaml.safe_load(SHIPPED.read_text())
    port = free_port()
    (application,) = config["applications"]
    config["http_options"]["port"] = port
    application["args"].update(port=port, replica_port=free_port(), redis_url=redis_url)
    application["deployments"][0].update(changes)
    return config


def the_same_but_ports_and_redis(changed: dict[str, Any]) -> bool:
    """Whether ``changed`` is the shipped config apart from the four overridden values."""
    shipped = yaml.safe_load(SHIPPED.read_text())
    changed = copy.deepcopy(changed)
    for config in (shipped, changed):
        config["http_options"].pop("port")
        for key in ("port", "replica_port", "redis_url"):
            config["applications"][0]["args"].pop(key)
    return bool(shipped == changed)


@dataclass
class ServeRun:
    process: subprocess.Popen[bytes]
    log: Path

    def said(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline or self.process.poll() is not None:
                ended = "" if self.process.poll() is None else " (serve run has exited)"
                pytest.fail(f"{what}: not within {timeout_s:.0f} s{ended}. serve run "
                            f"said:\n{self.said()[-6000:]}")
            time.sleep(0.5)


@contextlib.contextmanager
def serve_run(config: dict[str, Any], folder: Path, *extra: str) -> Iterator[ServeRun]:
    """``serve run`` on ``config`` (written to ``folder``) until the block ends. Stopped as
    a user stops it (Ctrl-C), its process group killed if that fails."""
    path, log = folder / "serve.yaml", folder / "serve-run.log"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with log.open("wb") as sink:
        process = subprocess.Popen([str(SERVE), "run", *extra, str(path)], cwd=ROOT,
                                   stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield ServeRun(process, log)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def classify(url: str, deadline: float) -> httpx.Response:
    """The photo, sent again after Retry-After while the replica is too busy (503)."""
    while True:
        response = httpx.post(f"{url}/v1/classify", content=photo("coffee.jpg"),
                              headers=JPEG, timeout=60)
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        time.sleep(min(float(response.headers["Retry-After"]), 5))


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt install redis-server)")
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ray_dir(ray_deadlines: dict[str, str]) -> Iterator[str]:
    """A folder for this module's Ray sessions (short: Ray's socket paths have a limit),
    and Serve's deadlines for a busy machine, in the environment Ray starts from."""
    folder = tempfile.mkdtemp(prefix="vgray-", dir="/tmp")
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**ray_deadlines, "RAY_TMPDIR": folder}.items():
            env.setenv(name, value)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def test_the_shipped_config_serves_on_this_machine_on_the_cpu(tmp_path, redis_url, ray_dir):
    config = config_for(redis_url)
    assert the_same_but_ports_and_redis(config)
    url = f"http://127.0.0.1:{config['http_options']['port']}"
    with serve_run(config, tmp_path) as run:  # starts a local Ray, as on a user's machine
        run.wait_for("the proxy answering /readyz", lambda: answers(f"{url}/readyz"),
                     READY_TIMEOUT_S)
        response = classify(url, time.monotonic() + 60)
        said = run.said()
    assert response.status_code == 200, response.text
    assert response.json()["predictions"][0]["label"] == "espresso"
    assert ("Placement: device is auto and no computer of the cluster has a GPU: each "
            "replica runs on the CPU" in said), said[-6000:]


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


@pytest.fixture(scope="module")
def gpu_ray(ray_dir: str) -> Iterator[str]:
    """A Ray head that reports one GPU and two CPUs (``ray start --num-gpus 1``), for the
    module, with this process connected to it; yields its address. Each test's ``serve
    run`` stops Serve when it ends (Ctrl-C); Ray stays until the module ends. Its own
    process, not ``ray.init`` here: a second local Ray started by one process (after
    test_cluster.py's) timed out starting its GCS."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = Path(ray_dir) / "ray-start.log"
    with pytest.MonkeyPatch.context() as env:
        # This process imported Ray before the variable could be set, and stayed without
        # token authentication even with RAY_AUTH_MODE=token set here: the test's Ray,
        # on 127.0.0.1, goes without it too.
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("HOME", str(Path(ray_dir) / "home"))  # not the real user's ~/.ray
        with log.open("wb") as sink:
            head = subprocess.Popen(
                [str(RAY), "start", "--head", "--block", f"--port={port}", "--num-gpus=1",
                 "--num-cpus=2", "--include-dashboard=false", "--node-ip-address=127.0.0.1",
                 "--disable-usage-stats"], stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not listening(port):
                if head.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"ray start: {log.read_text(errors='replace')[-4000:]}")
                time.sleep(0.5)
            ray.init(address=address)
            yield address
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            os.killpg(head.pid, signal.SIGTERM)  # ray start and the Ray processes it began
            try:
                head.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait(10)


def gpus_free() -> float:
    return float(ray.available_resources().get("GPU", 0))


def application_status() -> tuple[str, str]:
    """The application's status (a str enum: it equals its name) and message."""
    status = serve.status().applications.get(APP)
    return (status.status, status.message) if status else ("", "")


def test_where_ray_reports_a_gpu_each_replica_takes_one(tmp_path, redis_url, gpu_ray):
    config = config_for(redis_url)
    assert the_same_but_ports_and_redis(config) and gpus_free() == 1
    with serve_run(config, tmp_path, "--address", gpu_ray) as run:
        run.wait_for("the replica holding the GPU", lambda: gpus_free() == 0,
                     PLACED_TIMEOUT_S)
        said = run.said()
    assert ("Placement: device is auto and the cluster has 1 GPU: each replica takes one "
            "GPU of its own" in said), said[-6000:]


def test_replicas_no_computer_can_hold_fail_the_deploy_with_a_message(
        tmp_path, redis_url, gpu_ray):
    config = config_for(redis_url, ray_actor_options={"num_gpus": 2})
    with serve_run(config, tmp_path, "--address", gpu_ray) as run:
        run.wait_for("the deploy failing",
                     lambda: application_status()[0] == "DEPLOY_FAILED", PLACED_TIMEOUT_S)
        _, message = application_status()
    assert "each replica would need 2 GPU (as the config's ray_actor_options ask)" in message
    assert "remove ray_actor_options" in message
    # Nothing of the failed deploy holds the GPU. The previous test's replica may still be
    # giving it back on a busy machine (0 free, seen in CI): wait for that, bounded.
    deadline = time.monotonic() + 60
    while gpus_free() != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert gpus_free() == 1
