"""The engine as a Ray Serve deployment: every replica runs the appliance's app (its
engine, batcher, memory guard, warmup) behind Serve's HTTP proxy.

Run it with ``serve run deploy/ray/serve.yaml`` (or ``serve deploy``): ``build_app`` is
the config's ``import_path``, and the config's ``args`` are vramguard's settings (the
``Settings`` model, README's table), validated before anything starts. They act like the
appliance's command-line options: ``VRAMGUARD_*`` environment variables on a node (e.g.
the config's ``runtime_env.env_vars``, for a Redis password) fill in what args leave out;
no per-user config file is read. ``port`` is the port clients use: Serve's proxy port
(``http_options.port``), which the Host check compares with.

How it fits Serve (read in ray 2.60.0's source):

- Lifespan: ``serve.ingress()`` without an app calls ``__serve_build_asgi_app__`` in the
  replica after the constructor, then runs the app's ASGI lifespan startup in the replica
  (``ray/serve/_private/replica.py``, ``_initialize_asgi_callable``; uvicorn's
  ``LifespanOn`` in ``http_util.py``, ``ASGIAppReplicaWrapper``), and its shutdown from the
  replica's ``__del__`` on a graceful stop. So the engine starts in the replica exactly
  as in the appliance; a replica killed outright runs no shutdown (its decode processes
  end when their pipe closes).
- Health: ``check_health`` is ``/readyz``'s logic. Serve runs one check right after the
  constructor and the lifespan, and a replica is sent no traffic until it passes
  (``replica.py``, end of ``initialize``: "A new replica should not be considered healthy
  until it passes an initial health check"); that first check waits for the warmup, so a
  warming replica gets nothing (Serve has no start-up timeout, only slow-start warnings,
  ``deployment_state.py``). Later checks (every ``health_check_period_s``) fail when the
  engine has failed (a lost GPU): Serve then replaces the replica.
- 503s: the proxy relays the replica's ASGI messages as they are, status and headers
  included; it never retries on a status code (``proxy.py``,
  ``HTTPProxy.send_request_to_replica``). So 503 ``insufficient_memory`` and
  ``overloaded`` reach the client with their Retry-After from the replica that was full,
  and the client decides. The router retries only a replica that refused the request
  before taking it (its ``max_ongoing_requests`` reached) or that it found dead before
  sending (``router.py``, ``_route_and_send_request_once``); both are Serve's own
  admission, not vramguard's answers. ``max_ongoing_requests`` is set above the replica's
  own queue (``queue_size``) so that vramguard's 503 with Retry-After, not Serve's queue,
  is what a full replica answers.
- A replica that dies (``ray.kill``, a crash): requests it had already taken fail with
  the actor error, which the proxy answers as a bare 500 (``http_util.py``,
  ``get_http_response_status`` and ``send_http_response_on_exception``: only 408, 429 and
  503 get a body), or, with app/cluster/proxy.py's middleware in the proxy, as a JSON 503
  ``replica_lost`` with Retry-After. New requests go to the other replicas at once (the
  router drops a replica it finds dead, ``router.py``, ``ActorDiedError``), and Serve
  starts a replacement once a health check finds the actor gone.

Per-replica routes and ports (app/cluster/replica.py): through the proxy only the
inference routes and the health checks; each replica serves its own routes (admin calls,
``/metrics``, ``/v1/events``, ``/ui``, ``/v1/memory``, ``/v1/stats``) on ``host`` (default
127.0.0.1: only from its node) at ``replica_port`` plus its rank on its node (Serve's
``ReplicaContext.rank.local_rank``: 0, 1, ... per node, reused by a replacement). The
ports are deterministic, so Prometheus's scrape config lists them from the Serve config
alone: ``replica_port`` .. ``replica_port + replicas per node - 1`` on every node. Each
replica also logs its address ("replica N serves its own routes ... at URL"), and the
404 that the proxy answers for such a route names the port of the replica that answered.
Metrics carry a ``replica`` label: the replica's rank in the deployment (0 .. N-1, reused
by a replacement, so a replaced replica continues its series).

Rate limits: with ``redis_url`` every replica takes its tokens from Redis
(app/cluster/redis_limiter.py), so the limits hold for the whole deployment; without it,
each replica limits on its own.

Placement: on CUDA each replica takes one whole GPU (``num_gpus: 1``, which Ray shows it
as ``cuda:0``) and one CPU for its HTTP work and decoding; on the CPU it takes
``CPU_REPLICA_CPUS`` (Ray sets ``OMP_NUM_THREADS`` to it, so torch's threads follow).
Decode processes default to that CPU budget. The config's ``deployments`` section
overrides any of these, and sets the autoscaling (``target_ongoing_requests``,
``min_replicas``, ``max_replicas``); without it, ``replicas`` replicas run.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Mapping
from typing import Any

import ray
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp

from app.cluster.redis_limiter import RedisLimiter
from app.cluster.replica import Replica
from app.config import LOOPBACK_HOSTS, ConfigError, Settings
from app.engine.engine import InferenceEngine, Phase
from app.host.logs import FORMAT, RepeatThrottle

DEPLOYMENT = "vramguard"
CPU_REPLICA_CPUS = 1  # a CPU replica's default budget: its torch threads and decoders
GPU_REPLICA_CPUS = 1  # beside its GPU: HTTP, decoding and the device thread's Python
STARTING = frozenset({Phase.STARTING, Phase.LOADING, Phase.WARMING_UP})
WARMUP_POLL_S = 0.2
# A replica's queue (queue_size) must fill before Serve stops sending to it, so that the
# client gets vramguard's own 503 (Retry-After, its reason), not a wait in Serve's queue.
# The margin covers requests that are not images (/v1/models, health checks) and a full
# batch being computed.
ONGOING_MARGIN = 64


def _problem(error: ErrorDetails) -> str:
    name = ".".join(str(part) for part in error["loc"])
    if not name:
        return error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"'{name}' is not a vramguard setting: check its spelling (README, settings)"
    return f"setting '{name}' is invalid: {error['msg']}; got {error.get('input')!r}"


def settings_from(args: Mapping[str, Any]) -> Settings:
    """The settings in a Serve config's ``args`` (plus ``VRAMGUARD_*`` variables); a
    ConfigError naming every bad one, and the cluster's own rules."""
    try:
        settings = Settings(**args)
    except ValidationError as exc:
        problems = "; ".join(_problem(error) for error in exc.errors())
        raise ConfigError(f"vramguard's args in the Serve config: {problems}") from None
    if settings.device.startswith("cuda:"):
        raise ConfigError(f"device {settings.device!r}: Ray gives each replica a GPU of its "
                          "own, which it sees as the only one; set device to 'cuda' or "
                          "'auto'")
    if settings.host not in LOOPBACK_HOSTS and not settings.allow_remote:
        raise ConfigError(f"host {settings.host!r}: each replica's own routes (admin calls "
                          "included) would be reachable from other computers. Keep "
                          "127.0.0.1, or add allow_remote: true if that is what you want")
    return settings


def uses_gpu(settings: Settings) -> bool:
    """Whether each replica needs a GPU: asked for, or ``auto`` on a cluster that has
    some (read from Ray when it is running, as it is for ``serve run`` and ``serve
    deploy``)."""
    if settings.device == "cpu":
        return False
    if settings.device == "cuda":
        return True
    if not ray.is_initialized():
        return False
    resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    return resources.get("GPU", 0) > 0


def actor_options(settings: Settings) -> dict[str, float]:
    """What each replica reserves on its node."""
    if uses_gpu(settings):
        return {"num_gpus": 1, "num_cpus": GPU_REPLICA_CPUS}
    return {"num_cpus": CPU_REPLICA_CPUS}


def _log_to_stderr(level: str) -> None:
    """vramguard's log lines on the replica's stderr, which Ray keeps in the worker's log
    and forwards to the driver (Ray's own handlers stay as they are)."""
    logger = logging.getLogger("vramguard")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RepeatThrottle())
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


class VramguardReplica:
    """One replica: the engine and its two faces (app/cluster/replica.py)."""

    def __init__(self, args: dict[str, Any]) -> None:
        settings = settings_from(args)
        _log_to_stderr(settings.log_level)
        if settings.decode_workers is None:
            assigned: dict[str, float] = (
                ray.get_runtime_context().get_assigned_resources())  # type: ignore[no-untyped-call]
            budget = assigned.get("CPU", 1.0)
            settings = settings.model_copy(update={"decode_workers": max(1, int(budget))})
        context = serve.get_replica_context()
        rank = context.rank
        name, local_rank = (str(rank.rank), rank.local_rank) if rank else (
            context.replica_tag, 0)
        if settings.redis_url:
            limiter = RedisLimiter.from_settings(settings)
            self.replica = Replica(settings, name, local_rank, limiter=limiter,
                                   close_limiter=limiter.aclose)
        else:
            self.replica = Replica(settings, name, local_rank)
        self.warm = False

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self.replica.asgi

    async def check_health(self) -> None:
        """``/readyz``'s logic. The first check, which Serve makes before sending any
        traffic, waits for the warmup to end."""
        engine: InferenceEngine = self.replica.state.engine
        while not self.warm and engine.phase in STARTING:
            await asyncio.sleep(WARMUP_POLL_S)
        self.warm = True
        if not engine.ready:
            raise RuntimeError(f"replica {self.replica.name}: {engine.not_ready_message()}")


# ingress() without an app: Serve asks the replica for it (__serve_build_asgi_app__).
REPLICA = serve.deployment(name=DEPLOYMENT)(serve.ingress()(VramguardReplica))


def build_app(args: dict[str, Any]) -> Application:
    """The Serve config's ``import_path`` (``app.cluster.serve_app:build_app``): the
    deployment for vramguard's settings in ``args``, ConfigError for a bad one."""
    settings = settings_from(args)
    deployment = REPLICA.options(
        num_replicas=settings.replicas,
        ray_actor_options=actor_options(settings),
        max_ongoing_requests=settings.queue_size + ONGOING_MARGIN,
        graceful_shutdown_timeout_s=settings.request_timeout_s + 5)
    return deployment.bind(dict(args))
