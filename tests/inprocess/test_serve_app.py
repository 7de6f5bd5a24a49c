"""The cluster mode's parts that need no running cluster: the appliance never imports Ray
or Redis, a replica's two faces split the routes, the shipped Serve config builds, and a
bad setting in it is named. (tests/cluster/test_cluster.py runs the real thing.)"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from live_server import ROOT

from app.cluster.proxy import LostReplicaAnswer
from app.cluster.replica import Replica
from app.config import ConfigError, Settings

SERVE_YAML = ROOT / "deploy" / "ray" / "serve.yaml"
PROXY_PORT = 8000


def test_the_appliance_never_imports_ray_or_redis():
    code = ("import sys, app.http.server, app.cli.main, app.cli.process_control; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'redis'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[Replica]:
    """A replica's faces, not started (no model load); its own port bound, then closed."""
    from live_server import free_port

    settings = Settings(port=PROXY_PORT, replica_port=free_port(), device="cpu",
                        cache=False, token_file=tmp_path / "admin-token", decode_workers=1)
    made = Replica(settings, "3", 0)
    try:
        yield made
    finally:
        made.side.socket.close()


def client(app: Any, port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("127.0.0.1", 5000)),
                             base_url=f"http://127.0.0.1:{port}")


@pytest.mark.anyio
async def test_the_proxy_face_serves_only_what_any_replica_can_answer(replica):
    async with client(replica.asgi, PROXY_PORT) as proxy:
        models = await proxy.get("/v1/models")
        for path in ("/v1/memory", "/v1/stats", "/metrics", "/v1/events", "/ui"):
            per_process = await proxy.get(path)
            assert per_process.status_code == 404, path
            message = per_process.json()["error"]["message"]
            assert "replica_port" in message and replica.side.url not in message
        admin = await proxy.post("/v1/admin/pause")
        unknown = await proxy.get("/nope")
        wrong_method = await proxy.get("/v1/classify")
        oip = await proxy.get("/v2/health/live")
    assert models.status_code == 200 and oip.status_code == 200
    assert admin.status_code == 404 and "replica_port" in admin.json()["error"]["message"]
    assert unknown.status_code == 404 and "There is no /nope here" in unknown.text
    assert wrong_method.status_code == 405  # the app's own answer, as in the appliance


@pytest.mark.anyio
async def test_the_replica_port_serves_its_own_routes_and_sends_images_to_the_proxy(replica):
    async with client(replica.own, replica.side.port) as own:
        metrics = await own.get("/metrics")
        stats = await own.get("/v1/stats")
        image = await own.post("/v1/classify", content=b"x")
        oip_infer = await own.post("/v2/models/efficientnet_lite0/infer", json={})
        shutdown = await own.post("/v1/admin/shutdown")
        wrong_host = await own.get("/v1/stats", headers={"Host": f"127.0.0.1:{PROXY_PORT}"})
    assert metrics.status_code == 200 and stats.status_code == 200
    assert 'vramguard_ready{replica="3"} 0.0' in metrics.text
    assert all('replica="3"' in line for line in metrics.text.splitlines()
               if line.startswith("vramguard_"))
    assert image.status_code == 404 and f"proxy (port {PROXY_PORT})" in image.text
    assert oip_infer.status_code == 404 and "proxy" in oip_infer.json()["error"]
    assert shutdown.status_code == 404 and "serve shutdown" in shutdown.text
    assert wrong_host.status_code == 403  # the Host check names this port, not the proxy's


def test_a_replica_port_in_use_is_named(tmp_path, replica):
    settings = replica.state.settings.model_copy(update={"token_file": tmp_path / "t2"})
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{replica.side.port}.*replica_port"):
        Replica(settings, "4", 0)


def serve_app() -> ModuleType:
    """app.cluster.serve_app, which imports Ray and redis (skipped without the cluster
    extra)."""
    pytest.importorskip("redis", reason="the cluster extra is not installed")
    pytest.importorskip("ray", reason="the cluster extra is not installed")
    with warnings.catch_warnings():  # ray's pydantic fields use a deprecated style
        warnings.simplefilter("ignore", DeprecationWarning)
        from app.cluster import serve_app as module
    return module


def test_the_shipped_serve_config_builds():
    yaml = pytest.importorskip("yaml")
    module = serve_app()
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(SERVE_YAML.read_text())
    config = ServeDeploySchema.model_validate(raw)  # Serve's own rules for the file
    (application,) = raw["applications"]
    (deployment,) = application["deployments"]
    args = application["args"]
    assert application["import_path"] == "app.cluster.serve_app:build_app"
    assert deployment["name"] == module.DEPLOYMENT
    assert args["port"] == config.http_options.port
    assert args["replicas"] == deployment["autoscaling_config"]["max_replicas"]
    assert isinstance(module.build_app(args), Application)


CPU_NODE = {"CPU": 2.0, "memory": 4e9}
GPU_NODE = {"CPU": 8.0, "GPU": 1.0, "memory": 3e10}


@pytest.mark.parametrize(("device", "nodes", "options", "reason"), [
    ("auto", [CPU_NODE, GPU_NODE], {"num_gpus": 1, "num_cpus": 4},
     "device is auto and the cluster has 1 GPU: each replica takes one GPU"),
    ("auto", [CPU_NODE], {"num_cpus": 1}, "no computer of the cluster has a GPU"),
    ("auto", None, {"num_cpus": 1}, "Ray is not running yet"),
    ("cuda", [GPU_NODE], {"num_gpus": 1, "num_cpus": 4}, "device is cuda"),
    ("cuda", [{"CPU": 6.0, "GPU": 4.0}, GPU_NODE], {"num_gpus": 1, "num_cpus": 1},
     "device is cuda"),  # 1.5 CPUs per GPU on the first: every GPU there holds a replica
    ("cuda", None, {"num_gpus": 1, "num_cpus": 1}, "device is cuda"),
    ("cpu", [GPU_NODE], {"num_cpus": 1}, "device is cpu"),
])
def test_replicas_follow_the_device_and_the_gpus_ray_reports(device, nodes, options, reason):
    from app.cluster.placement import choose

    placement = choose(Settings(device=device), nodes)
    assert placement.options == options and reason in placement.reason


def test_replica_cpus_is_what_each_replica_reserves():
    from app.cluster.placement import choose

    assert choose(Settings(device="cuda", replica_cpus=2), [GPU_NODE]).options == {
        "num_gpus": 1, "num_cpus": 2}
    assert choose(Settings(device="cpu", replica_cpus=2), [CPU_NODE]).options == {
        "num_cpus": 2}


def test_cuda_on_a_cluster_without_a_gpu_is_refused_with_what_to_do():
    from app.cluster.placement import choose

    with pytest.raises(ConfigError, match=r"no computer of this Ray cluster has a GPU.*'auto'"):
        choose(Settings(device="cuda"), [CPU_NODE])


@pytest.mark.parametrize(("options", "short"), [
    ({"num_gpus": 1}, "1 GPU"),
    ({"num_cpus": 4}, "4 CPU"),
    ({"num_cpus": 1, "resources": {"tpu": 1}}, "1 tpu"),
])
def test_replicas_no_node_can_hold_are_refused_naming_what_is_missing(options, short):
    from app.cluster.placement import check

    with pytest.raises(ConfigError, match=f"would need {short} .*config's ray_actor_options"):
        check(options, [CPU_NODE], from_config=True)
    check({"num_gpus": 1, "num_cpus": 8}, [CPU_NODE, GPU_NODE], from_config=True)


@pytest.mark.parametrize(("args", "named"), [
    ({"modle": "resnet50"}, "'modle' is not a vramguard setting"),
    ({"queue_size": 0}, "setting 'queue_size' is invalid"),
    ({"device": "cuda:1"}, "set device to 'cuda' or 'auto'"),
    ({"host": "0.0.0.0"}, "allow_remote"),
])
def test_a_bad_setting_in_the_serve_config_is_named(args, named):
    build_app = serve_app().build_app
    with pytest.raises(ConfigError, match=named):
        build_app(args)


async def _proxy_sent_nothing(scope: Any, receive: Any, send: Any) -> None:
    """Serve's proxy for a request whose replica died: it returns without an answer."""


async def _proxy_answered(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 429, "headers": []})
    await send({"type": "http.response.body", "body": b"slow down"})


@pytest.mark.anyio
async def test_a_request_lost_with_its_replica_gets_503_with_retry_after():
    async with client(LostReplicaAnswer(_proxy_sent_nothing), PROXY_PORT) as proxy:
        lost = await proxy.post("/v1/classify")
        lost_oip = await proxy.post("/v2/models/m/infer")
    async with client(LostReplicaAnswer(_proxy_answered), PROXY_PORT) as proxy:
        answered = await proxy.post("/v1/classify")
    assert lost.status_code == 503 and lost.headers["Retry-After"] == "1"
    assert lost.json()["error"]["code"] == "replica_lost"
    assert lost_oip.status_code == 503 and "send it again" in lost_oip.json()["error"]
    assert answered.status_code == 429 and answered.text == "slow down"
