"""Where the replicas run (issue 24): the Ray resources each replica asks for, chosen when
the application is built, from vramguard's ``device`` and the nodes Ray reports then.

- ``device: cpu``: CPU replicas of ``CPU_REPLICA_CPUS`` CPUs (Ray sets
  ``OMP_NUM_THREADS`` to it, so torch's threads follow).
- ``device: cuda``: one whole GPU per replica (Ray shows it as ``cuda:0``) and CPUs for
  its HTTP work and decoding (each CPU a decoder: one would leave the GPU waiting for
  images): as many as each GPU of the GPU computer with the fewest CPUs per GPU leaves,
  up to ``GPU_REPLICA_CPUS``; 1 while Ray is not running to say. Refused on a cluster
  without a GPU.
- ``replica_cpus`` set: that many CPUs per replica, on the CPU or a GPU.
- ``device: auto``: a GPU per replica where some node has a GPU, CPU replicas otherwise.

The Serve config's ``deployments`` section may still set ``ray_actor_options``; Serve
then uses it instead of this choice, as a whole, not merged key by key (ray 2.60.0,
``serve/_private/application_state.py``, ``override_deployment_info``; a missing
``num_cpus`` becomes 1, ``serve/_private/config.py``). It is held to the same rule below.

Either way, replicas that no node can hold (a GPU on a cluster without one, more CPUs
than the largest node has) fail the build with a message saying what is missing and what
to change: Serve itself would wait for such a node for ever, warning every 30 s. The
nodes are those alive when the application is built, so GPU nodes that an autoscaler
would add later are not counted: deploy again once they are up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.config import ConfigError, Settings

CPU_REPLICA_CPUS = 1  # a CPU replica's budget: its torch threads and decoders
GPU_REPLICA_CPUS = 4  # at most, beside its GPU: HTTP, decoders, the device thread's Python
SERVE_DEFAULT_CPUS = 1  # what Serve gives a replica whose ray_actor_options leave it out
Node = Mapping[str, float]  # one alive node's total resources ("CPU", "GPU", ...)
OPTION_RESOURCES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


@dataclass(frozen=True)
class Placement:
    options: dict[str, float]  # each replica's ray_actor_options
    reason: str  # what was chosen and why, for the log


def choose(settings: Settings, nodes: Sequence[Node] | None) -> Placement:
    """Each replica's resources for ``settings.device`` on a cluster of ``nodes`` (None:
    Ray is not running yet, so its GPUs cannot be counted)."""
    gpus = sum(node.get("GPU", 0) for node in nodes or ())
    on_cpu: dict[str, float] = {"num_cpus": settings.replica_cpus or CPU_REPLICA_CPUS}
    on_gpu: dict[str, float] = {"num_gpus": 1,
                                "num_cpus": settings.replica_cpus or gpu_replica_cpus(nodes)}
    if settings.device == "cpu":
        return Placement(on_cpu, "device is cpu: each replica runs on the CPU")
    if settings.device == "cuda" and (nodes is None or gpus > 0):
        return Placement(on_gpu, "device is cuda: each replica takes one GPU of its own")
    if settings.device == "cuda":
        raise ConfigError("device is 'cuda', but no computer of this Ray cluster has a GPU "
                          "(Ray counts none), so no replica could ever start. Set device "
                          "to 'auto' to run the replicas on the CPU, or start Ray on a "
                          "computer with an NVIDIA GPU and deploy again")
    if gpus > 0:
        return Placement(on_gpu, f"device is auto and the cluster has {gpus:g} "
                         f"GPU{'s' * (gpus != 1)}: each replica takes one GPU of its own")
    if nodes is None:
        return Placement(on_cpu, "device is auto and Ray is not running yet, so its GPUs "
                         "cannot be counted: each replica runs on the CPU (deploy a config "
                         "file, e.g. serve run deploy/ray/serve.yaml, to have them counted, "
                         "or set device to cuda)")
    return Placement(on_cpu, "device is auto and no computer of the cluster has a GPU: "
                     "each replica runs on the CPU")


def gpu_replica_cpus(nodes: Sequence[Node] | None) -> int:
    """CPUs for a GPU replica: what each GPU of the GPU computer with the fewest CPUs per
    GPU leaves (so that every GPU there can hold a replica), from 1 to GPU_REPLICA_CPUS."""
    shares = [node.get("CPU", 0) / node["GPU"] for node in nodes or () if node.get("GPU")]
    if not shares:
        return 1
    return int(max(1, min(GPU_REPLICA_CPUS, min(shares))))


def demand(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources one replica with these ``ray_actor_options`` waits for."""
    wanted = {"CPU": float(SERVE_DEFAULT_CPUS)}
    for option, resource in OPTION_RESOURCES.items():
        if options.get(option) is not None:
            wanted[resource] = float(options[option])
    wanted.update({name: float(amount) for name, amount in
                   (options.get("resources") or {}).items()})
    return {name: amount for name, amount in wanted.items() if amount > 0}


def check(options: Mapping[str, Any], nodes: Sequence[Node], *, from_config: bool) -> None:
    """ConfigError unless some node can hold a replica asking for ``options``: vramguard's
    choice, or the config's ``ray_actor_options`` (``from_config``)."""
    wanted = demand(options)
    if any(all(node.get(name, 0) >= amount for name, amount in wanted.items())
           for node in nodes):
        return
    largest = {name: max((node.get(name, 0) for node in nodes), default=0)
               for name in wanted}
    short = ", ".join(f"{amount:g} {name}" for name, amount in wanted.items()
                      if largest[name] < amount)
    have = ", ".join(f"{largest[name]:g} {name}" for name in wanted)
    source, hint = (
        ("as the config's ray_actor_options ask", "remove ray_actor_options from the "
         "config's deployments section: vramguard then gives each replica a GPU where the "
         "cluster has one, and runs it on the CPU otherwise") if from_config else
        ("as vramguard placed it", "start Ray with more (ray start --num-cpus N)"))
    raise ConfigError(f"each replica would need {short} ({source}), but no computer of "
                      f"this Ray cluster has that much (the largest has {have}), so no "
                      f"replica could ever start. To run here, {hint}")
