"""The appliance against the same engine as Ray Serve replicas (issue 17), in one run.

    python -m bench.cluster [--seconds 12] [--rounds 2] [--concurrency 16]

Needs the cluster extra (``pip install -e '.[cluster]'``) and Debian's ``redis-server``.
Starts a Redis, the appliance (``python -m app serve``) and a local Ray with Serve's
proxy, all on 127.0.0.1, and measures with the same image and closed-loop load
generator as ``bench.run``:

- the proxy's cost: one Serve replica against the appliance at concurrency 1 (p50 and
  the throughput ratio; the replica also takes its token from Redis, one round trip);
- one replica against two at ``--concurrency`` (two replicas on a 2-core machine share
  the same two cores, so no gain is expected: each replica's forward pass already uses
  both cores through torch's threads);
- Redis round trips per request, from Redis's own command counts.

The deployment alternates between one and two replicas, round by round (one, two; then
two, one), and the appliance is measured in every round next to it, so that a machine
whose speed drifts slows every setup alike. Both sides run the same batch size and
limits high enough never to refuse the load. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import LoadResult, run_load
from bench.process import free_port, running, server_env
from bench.redis_server import RedisServer
from bench.run import IMAGE, machine

APP = "vramguard"
BATCH = 4
# Limits far above what this machine can serve: the benchmark measures serving, not 429s.
OPEN_LIMITS = {"classify_burst": 100_000, "classify_per_s": 100_000.0,
               "global_burst": 100_000, "global_per_s": 100_000.0}
DEPLOY_TIMEOUT_S = 300


def _serve_args(port: int, replica_port: int, redis_url: str, replicas: int,
                work: Path) -> dict[str, Any]:
    return {"port": port, "replica_port": replica_port, "device": "cpu", "replicas": replicas,
            "redis_url": redis_url, "redis_prefix": "vgbench", "batch_size": BATCH,
            "max_batch_size": BATCH, "cache": False, "log_level": "warning",
            "token_file": str(work / "admin-token"), "profile_dir": str(work / "profiles"),
            "log_dir": str(work / "logs"), **OPEN_LIMITS}


@contextlib.contextmanager
def appliance(work: Path) -> Iterator[tuple[str, int]]:
    """The appliance on a free port with the same batch size and open limits."""
    port = free_port()
    env = server_env(VRAMGUARD_CACHE_DIR=str(work / "appliance-cache"),
                     VRAMGUARD_PROFILE_DIR=str(work / "appliance-profiles"),
                     **{f"VRAMGUARD_{key.upper()}": str(value)
                        for key, value in OPEN_LIMITS.items()})
    command = [sys.executable, "-m", "app", "serve", "--log-level", "warning", "--no-cache",
               "--port", str(port), "--batch-size", str(BATCH)]
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/readyz", work / "appliance.log", env) as process:
        yield f"{url}/v1/classify", process.pid


class Serve:
    """A local Ray with Serve's proxy on 127.0.0.1, deploying vramguard with n replicas."""

    def __init__(self, redis_url: str, work: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import ray
            from ray import serve

            from app.cluster.serve_app import DEPLOYMENT, build_app
        self.ray, self.serve, self.deployment, self.build = ray, serve, DEPLOYMENT, build_app
        self.port, self.replica_port = free_port(), free_port()
        self.redis_url, self.work = redis_url, work
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False,
                 log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/classify"

    def running(self) -> int:
        status = self.serve.status().applications.get(APP)
        if status is None or self.deployment not in status.deployments:
            return 0
        states = status.deployments[self.deployment].replica_states
        return sum(count for state, count in states.items() if str(state) == "RUNNING")

    def deploy(self, replicas: int) -> float:
        """Deploy (or redeploy) with ``replicas`` replicas; seconds until all serve."""
        started = time.monotonic()
        args = _serve_args(self.port, self.replica_port, self.redis_url, replicas, self.work)
        # serve.run blocks until the application is running; its own thread lets this
        # one watch the replicas and give up with a message.
        deploying = threading.Thread(target=self.serve.run, args=(self.build(args),),
                                     kwargs={"name": APP, "route_prefix": "/"}, daemon=True)
        deploying.start()
        deploying.join(DEPLOY_TIMEOUT_S)
        while self.running() != replicas or _status(self.url) != 200:
            if time.monotonic() - started > DEPLOY_TIMEOUT_S:
                raise RuntimeError(f"{replicas} replica(s) not serving within "
                                   f"{DEPLOY_TIMEOUT_S} s: {self.serve.status()}")
            time.sleep(0.5)
        return time.monotonic() - started

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.serve.shutdown()
        self.ray.shutdown()


def _status(url: str) -> int:
    try:
        return httpx.post(url, content=IMAGE.read_bytes(),
                          headers={"Content-Type": "image/jpeg"}, timeout=30).status_code
    except httpx.HTTPError:
        return 0


def _evalsha_calls(port: int) -> int:
    """EVALSHA calls Redis has answered so far (INFO commandstats)."""
    import redis

    client = redis.Redis(port=port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _load(url: str, concurrency: int, seconds: float, pid: int | None = None) -> LoadResult:
    return asyncio.run(run_load(url, IMAGE.read_bytes(), concurrency, seconds, pid))


def _row(name: str, result: LoadResult) -> str:
    return (f"| {result.concurrency} | {name} | {result.requests_per_second:.1f} | "
            f"{result.percentile(50) * 1000:.0f} | {result.percentile(99) * 1000:.0f} | "
            f"{result.errors} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=12.0,
                        help="per setup, level and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    options = parser.parse_args()
    if shutil.which("redis-server") is None:
        print("bench.cluster: redis-server is not installed (Debian: apt install "
              "redis-server)", file=sys.stderr)
        return 2
    print(f"machine: {machine()}", flush=True)
    pooled: dict[tuple[str, int], LoadResult] = {}
    deploy_s: list[float] = []
    calls = 0

    def add(name: str, result: LoadResult) -> None:
        key = (name, result.concurrency)
        pooled[key] = pooled[key].merge(result) if key in pooled else result
        print(f"  {_row(name, result)}", flush=True)

    with tempfile.TemporaryDirectory(prefix="vg-bench-cluster-") as folder:
        work = Path(folder)
        redis_server = RedisServer(work / "redis")
        redis_server.start()
        try:
            with appliance(work) as (local_url, pid):
                cluster = Serve(redis_server.url, work)
                try:
                    for round_ in range(options.rounds):
                        order = (1, 2) if round_ % 2 == 0 else (2, 1)
                        for replicas in order:
                            deploy_s.append(cluster.deploy(replicas))
                            _load(cluster.url, 2, 2.0)  # settle: connections, first batches
                            before = _evalsha_calls(redis_server.port)
                            if replicas == 1:
                                add("appliance", _load(local_url, 1, options.seconds, pid))
                                add("serve, 1 replica", _load(cluster.url, 1, options.seconds))
                            add(f"serve, {replicas} replica{'s' * (replicas > 1)}",
                                _load(cluster.url, options.concurrency, options.seconds))
                            add("appliance", _load(local_url, options.concurrency,
                                                   options.seconds, pid))
                            calls += _evalsha_calls(redis_server.port) - before
                finally:
                    cluster.close()
        finally:
            redis_server.stop()

    c = options.concurrency
    one, two = pooled["serve, 1 replica", c], pooled["serve, 2 replicas", c]
    alone, proxied = pooled["appliance", 1], pooled["serve, 1 replica", 1]
    total = sum(result.ok + result.errors for (name, _), result in pooled.items()
                if name.startswith("serve"))
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    print(f"machine: {machine()}\n")
    print("| c | setup | req/s | p50 ms | p99 ms | errors |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, _level), result in sorted(pooled.items(), key=lambda item: (item[0][1],
                                                                             item[0][0])):
        print(_row(name, result))
    print(f"\nproxy cost at c=1: p50 {proxied.percentile(50) * 1000:.1f} ms through Serve vs "
          f"{alone.percentile(50) * 1000:.1f} ms direct (+"
          f"{(proxied.percentile(50) - alone.percentile(50)) * 1000:.1f} ms); throughput "
          f"{proxied.requests_per_second / alone.requests_per_second:.3f}x the appliance's")
    print(f"two replicas / one at c={c}: "
          f"{two.requests_per_second / one.requests_per_second:.3f}x; one replica / "
          f"appliance at c={c}: "
          f"{one.requests_per_second / pooled['appliance', c].requests_per_second:.3f}x")
    print(f"Redis round trips per request through Serve: {calls / max(1, total):.3f} "
          f"({calls} EVALSHA for {total} requests)")
    print(f"deploys (s): {', '.join(f'{s:.0f}' for s in deploy_s)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
