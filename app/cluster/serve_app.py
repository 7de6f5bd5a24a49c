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
404 that the proxy answers for such a route says how those ports are chosen (never the
address of the replica that answered: anyone who reaches the proxy reads it).
Metrics carry a ``replica`` label: the replica's rank in the deployment (0 .. N-1, reused
by a replacement, so a replaced replica continues its series).

Rate limits: with ``redis_url`` every replica takes its tokens from Redis
(app/cluster/redis_limiter.py), so the limits hold for the whole deployment; without it,
each replica limits on its own.

Placement (app/cluster/placement.py): ``build_app`` counts the GPUs of the nodes Ray
reports when it builds; with ``device: auto`` each replica then takes one GPU where there
are some and runs on the CPU where there are none, and the log says which and why. Decode
processes default to the replica's CPU budget. A ``ray_actor_options`` in the config's
``deployments`` section replaces that choice (Serve's rule); ``build_app`` reads it from
the Serve controller, which stores the config before it starts the build
(``controller.py``, ``apply_config``; ``get_app_configs``), and holds it to the same
check: replicas no node can hold fail the deploy with a message. The section also sets
the autoscaling (``target_ongoing_requests``, ``min_replicas``, ``max_replicas``);
without it, ``replicas`` replicas run.
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
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.exceptions import RayServeException
from ray.serve.schema import ServeApplicationSchema
from starlette.types import ASGIApp

from app.cluster.placement import Node, check, choose
from app.cluster.redis_limiter import RedisLimiter
from app.cluster.replica import Replica
from app.config import LOOPBACK_HOSTS, ConfigError, Settings
from app.engine.engine import InferenceEngine, Phase
from app.host.logs import FORMAT, RepeatThrottle

log = logging.getLogger("vramguard.cluster")
DEPLOYMENT = "vramguard"
IMPORT_PATH = "app.cluster.serve_app:build_app"  # the Serve config's import_path
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


def cluster_nodes() -> list[Node] | None:
    """The total resources of each alive node; None when Ray is not running (``serve
    run`` with an import path builds before it starts Ray)."""
    if not ray.is_initialized():
        return None
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [node["Resources"] for node in nodes if node["Alive"]]


def configured_actor_options(args: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``ray_actor_options`` that the Serve config deploying these ``args`` gives the
    deployment, which Serve uses instead of vramguard's; None when it gives none, or
    when no Serve config is being deployed (``serve.run`` from Python)."""
    if not ray.is_initialized():
        return None
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # no Serve yet
        return None
    reply: Any = controller.get_app_configs.remote()
    configs: dict[str, ServeApplicationSchema] = ray.get(reply)
    for config in configs.values():
        if config.import_path != IMPORT_PATH or config.args != args:
            continue
        for deployment in config.model_dump(exclude_unset=True).get("deployments", []):
            if deployment["name"] == DEPLOYMENT and "ray_actor_options" in deployment:
                options: dict[str, Any] = deployment["ray_actor_options"]
                return options
    return None


def actor_options(settings: Settings, args: Mapping[str, Any]) -> dict[str, Any]:
    """What each replica reserves on its node, checked against the nodes there are, and
    logged with the reason."""
    nodes = cluster_nodes()
    placement = choose(settings, nodes)
    configured = configured_actor_options(args)
    if nodes is not None:
        check(placement.options if configured is None else configured, nodes,
              from_config=configured is not None)
    if configured is None:
        log.info("Placement: %s (ray_actor_options %s).", placement.reason, placement.options)
        return dict(placement.options)
    log.info("Placement: the config's ray_actor_options %s, in place of vramguard's "
             "choice (%s).", configured, placement.reason)
    return configured


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


class UnusableConfig(ConfigError, RayServeException):
    """A Serve config vramguard cannot run. A RayServeException, so that Serve fails the
    deploy at once with this message (``application_state.py``,
    ``build_serve_application``), instead of building again three times (it retries
    other exceptions) and showing a traceback."""


def build_app(args: dict[str, Any]) -> Application:
    """The Serve config's ``import_path`` (``app.cluster.serve_app:build_app``): the
    deployment for vramguard's settings in ``args``; UnusableConfig for a bad one, or
    for replicas that no node could hold."""
    try:
        settings = settings_from(args)
        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            _log_to_stderr(settings.log_level)  # Serve's build task: show the placement
        options = actor_options(settings, args)
    except ConfigError as error:
        raise UnusableConfig(str(error)) from None
    deployment = REPLICA.options(
        num_replicas=settings.replicas,
        ray_actor_options=options,
        max_ongoing_requests=settings.queue_size + ONGOING_MARGIN,
        graceful_shutdown_timeout_s=settings.request_timeout_s + 5)
    return deployment.bind(dict(args))
