"""A manifest that drifts from the code fails here: settings, ports, health checks, placement, versions.

Every value is read from the code that uses it (the settings classes as a pod constructs them, the
Serve application as build_app builds it, Ray's and Serve's own defaults), never restated here.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from typing import Any
from unittest import mock

import pytest
import ray
from pydantic import SecretStr
from pydantic_settings import BaseSettings
from ray.serve.schema import HTTPOptionsSchema

from deploy.manifests import (
    ROOT,
    Manifest,
    any_value_secrets,
    container_env,
    find,
    loom_app_args,
    one,
    pod_templates,
    quantity,
    ray_custom_resources,
    ray_groups,
    ray_num_cpus,
    ray_num_gpus,
)
from gateway.grpc.stubs import SERVICE_NAME
from gateway.http.server import HttpFront
from gateway.settings import ClientSettings, GatewaySettings
from kernels.settings import KernelSettings
from protocol.engine_config import EngineConfig
from tenancy import TenancySettings

from .test_schemas import build_from_manifest

REPO = ROOT.parent
SETTINGS: tuple[type[BaseSettings], ...] = (
    GatewaySettings,
    ClientSettings,
    TenancySettings,
    EngineConfig,
    KernelSettings,
)
# Ports Ray and KubeRay hold on a Ray pod, whatever Loom does: Serve's HTTP proxy (on every node with
# a replica, gateway pods included), KubeRay's default metrics-export-port and dashboard agent port,
# and on the head GCS, the dashboard and the Ray client server.
RAY_PORTS = {HTTPOptionsSchema().port, 8080, 52365, 6379, 8265, 10001}


def _variables(cls: type[BaseSettings]) -> dict[str, str]:
    """Environment variable -> field name, as pydantic-settings reads them."""
    prefix = cls.model_config.get("env_prefix", "")
    out = {}
    for name, info in cls.model_fields.items():
        alias = info.validation_alias
        out[(alias if isinstance(alias, str) else prefix + name).upper()] = name
    return out


KNOWN_VARIABLES = {v: (cls, f) for cls in SETTINGS for v, f in _variables(cls).items()}


def _ray_envs(objects: list[Manifest]) -> dict[str, dict[str, str]]:
    secrets = any_value_secrets(objects)
    return {
        p.group: container_env(p.containers[0], objects, secrets)
        for p in pod_templates(objects)
        if p.group is not None
    }


def _gateway_settings(objects: list[Manifest]) -> GatewaySettings:
    with mock.patch.dict(os.environ, _ray_envs(objects)["gateway"], clear=True):
        return GatewaySettings()


def test_every_loom_variable_is_a_settings_field(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        named = [k for cm in find(objects, "ConfigMap") for k in cm.get("data", {})]
        for pod in pod_templates(objects):
            for c in pod.containers:
                named += [v["name"] for v in c.get("env", [])]
        loom = {n for n in named if n.startswith("LOOM_")}
        assert loom, overlay
        unknown = loom - set(KNOWN_VARIABLES)
        assert not unknown, f"{overlay}: no settings class reads {sorted(unknown)}"


def test_every_ray_pod_sees_the_same_loom_settings(rendered: dict[str, list[Manifest]]) -> None:
    """build_app runs on whichever node Serve picks and its replicas read their environment where
    they land: every group must give the same LOOM_* values, but for the secrets only gateway pods
    hold (tests/deploy/test_schemas.py)."""
    secrets = {"LOOM_TENANCY_SECRET", "LOOM_TENANCY_REDIS_PASSWORD"}
    for overlay, objects in rendered.items():
        envs = {
            group: {k: v for k, v in env.items() if k.startswith("LOOM_") and k not in secrets}
            for group, env in _ray_envs(objects).items()
        }
        assert len({tuple(sorted(e.items())) for e in envs.values()}) == 1, overlay


def test_settings_read_what_the_pods_get(rendered: dict[str, list[Manifest]]) -> None:
    """Each class builds from a pod's environment, and each LOOM_* value arrives in its field."""
    for overlay, objects in rendered.items():
        for group, env in _ray_envs(objects).items():
            with mock.patch.dict(os.environ, env, clear=True):
                built = {cls: cls() for cls in SETTINGS}  # raises on a value a field refuses
            for name, raw in env.items():
                if name.startswith("LOOM_"):
                    cls, field = KNOWN_VARIABLES[name]
                    value = getattr(built[cls], field)
                    if isinstance(value, SecretStr):
                        value = value.get_secret_value()
                    assert _same(value.value if isinstance(value, Enum) else value, raw), (
                        overlay,
                        group,
                        name,
                    )


def _same(parsed: Any, raw: str) -> bool:
    """Numbers and paths compare by value ("30" == 30.0, "/a/b" == Path("/a/b"))."""
    try:
        return float(raw) == float(parsed)
    except (TypeError, ValueError):
        return str(parsed) == raw


def test_gateway_ports_match_its_settings(rendered: dict[str, list[Manifest]]) -> None:
    defaults = GatewaySettings.model_fields
    for overlay, objects in rendered.items():
        settings = _gateway_settings(objects)
        (gateway,) = [p for p in pod_templates(objects) if p.group == "gateway"]
        ports = {p["name"]: p["containerPort"] for p in gateway.containers[0]["ports"]}
        expected = {"grpc": settings.port, "http": settings.http_port, "loom-metrics": settings.metrics_port}
        assert ports == expected, overlay
        assert not set(ports.values()) & RAY_PORTS, f"{overlay}: a gateway port collides with Ray's"
        service = one(objects, "Service", "loom-gateway")
        published = {p["port"]: ports[p["targetPort"]] for p in service["spec"]["ports"]}
        # Clients use the ports `loom serve` uses: gRPC 50051, HTTP 8000, metrics 9464.
        assert published == {
            defaults["port"].default: settings.port,
            defaults["http_port"].default: settings.http_port,
            defaults["metrics_port"].default: settings.metrics_port,
        }, overlay
        assert settings.host == settings.metrics_host == "0.0.0.0", overlay


def test_health_checks_ask_what_the_gateway_serves(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        settings = _gateway_settings(objects)
        routes = {r.path for r in HttpFront(None, settings, serving=lambda: True).app.routes}  # type: ignore[arg-type]
        (gateway,) = [p for p in pod_templates(objects) if p.group == "gateway"]
        probe = gateway.containers[0]["readinessProbe"]
        ports = {p["name"]: p["containerPort"] for p in gateway.containers[0]["ports"]}
        if "httpGet" in probe:
            get = probe["httpGet"]
            assert get["path"] in routes and get["path"] == "/health", overlay
            assert ports.get(get["port"], get["port"]) == settings.http_port, overlay
            assert get.get("scheme", "HTTP") == ("HTTPS" if settings.tls else "HTTP"), overlay
        else:
            grpc = probe["grpc"]  # the kubelet's gRPC probe: plaintext only
            assert not settings.tls, f"{overlay}: a gRPC probe cannot reach a TLS server"
            assert grpc["service"] == SERVICE_NAME and grpc["port"] == settings.port, overlay
        for pod in pod_templates(objects):
            for c in pod.containers:
                for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                    if "grpc" in c.get(kind, {}):
                        assert c[kind]["grpc"].get("service") == SERVICE_NAME, (overlay, pod.owner)
    # the docs show the gRPC health check with the service name the server registers
    assert f'"service": "{SERVICE_NAME}"' in (REPO / "docs" / "deploy.md").read_text()


def test_replicas_land_on_the_pods_meant_for_them(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        groups = ray_groups(one(objects, "RayService"))
        deployments = build_from_manifest(objects)
        for name, deployment in deployments.items():
            options = deployment.ray_actor_options
            wanted = options.get("resources", {})
            assert wanted, f"{overlay}: {name} names no Ray resource, so it could land on any pod"
            hosts = [
                g
                for g, spec in groups.items()
                if all(ray_custom_resources(spec).get(k, 0) >= v for k, v in wanted.items())
            ]
            assert len(hosts) == 1, (overlay, name, hosts)
            spec = groups[hosts[0]]
            assert options.get("num_cpus", 1) <= ray_num_cpus(spec), (overlay, name)
            assert options.get("num_gpus", 0) <= ray_num_gpus(spec), (overlay, name)
            grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
            shutdown = deployment._deployment_config.graceful_shutdown_timeout_s
            assert grace >= shutdown, f"{overlay}: {name} drains {shutdown} s, its pod is killed at {grace}"
        assert ray_num_cpus(groups["head"]) == 0, overlay  # no replica on the head


def test_replica_counts_agree(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        groups = ray_groups(one(objects, "RayService"))
        args = loom_app_args(one(objects, "RayService"))
        gateway = groups["gateway"]
        with mock.patch.dict(os.environ, _ray_envs(objects)["gateway"], clear=True):
            fail_static_n = TenancySettings().gateway_replicas
        counts = {
            "serve gateway_replicas": args["gateway_replicas"],
            "LOOM_TENANCY_GATEWAY_REPLICAS": fail_static_n,
            "gateway pods": gateway["replicas"],
            "gateway minReplicas": gateway["minReplicas"],
            "gateway maxReplicas": gateway["maxReplicas"],
        }
        assert len(set(counts.values())) == 1, (overlay, counts)
        units = ray_custom_resources(gateway)["loom_gateway"] / args["gateway_resources"]["loom_gateway"]
        assert units == 1, overlay  # one gateway per pod: the Service balances pods
        engine = groups["engine"]
        for pool in args["pools"]:
            per_pod = ray_custom_resources(engine)["loom_engine"] // pool["resources"]["loom_engine"]
            most = pool["replicas"]
            if pool.get("autoscale"):
                most = max(most, pool.get("max_replicas", 1))
            assert most <= engine["maxReplicas"] * per_pod, (overlay, pool["name"])
            assert pool["replicas"] <= engine["minReplicas"] * per_pod, (overlay, pool["name"])


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_ray_version_is_one_everywhere(rendered: dict[str, list[Manifest]]) -> None:
    (pinned,) = re.findall(r"^ARG RAY_VERSION=\"?([0-9.]+)\"?", _dockerfile(), re.M)
    for overlay, objects in rendered.items():
        assert one(objects, "RayService")["spec"]["rayClusterConfig"]["rayVersion"] == pinned, overlay
    assert ray.__version__ == pinned  # the version the code and these tests run


def test_one_image_for_every_ray_pod(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        images = {p.containers[0]["image"] for p in pod_templates(objects) if p.group is not None}
        assert len(images) == 1, (overlay, images)


def test_dockerfile_builds_what_the_pods_need() -> None:
    text = _dockerfile()
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in include["include"]} - {"loomapi"}  # loomapi is generated
    copied = set(re.findall(r"^COPY (\S+) \1$", text, re.M))
    assert packages <= copied, f"the image misses {sorted(packages - copied)}"
    (user,) = re.findall(r"^USER (\S+)$", text, re.M)
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root uid (runAsNonRoot checks it)"
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.M)
    state = f"{workdir}/{TenancySettings().tenants_file.parent}"  # where `loom serve` keeps its state
    assert re.search(rf"mkdir -p {re.escape(state)}\b.*chown {uid}:", text, re.S), state
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    defaults = GatewaySettings.model_fields
    assert exposed == {defaults[f].default for f in ("port", "http_port", "metrics_port")}
    caches = dict(re.findall(r"(XDG_CACHE_HOME|TRITON_CACHE_DIR)=(\S+)", text))
    assert set(caches) == {"XDG_CACHE_HOME", "TRITON_CACHE_DIR"}
    assert all(v.startswith("/tmp/") for v in caches.values()), "caches must be on the /tmp volume"


@pytest.mark.parametrize("overlay", ["cpu-dev", "gpu"])
def test_engine_pods_have_what_their_replicas_need(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    objects = rendered[overlay]
    engine = ray_groups(one(objects, "RayService"))["engine"]
    container = engine["template"]["spec"]["containers"][0]
    env = _ray_envs(objects)["engine"]
    with mock.patch.dict(os.environ, env, clear=True):
        config = EngineConfig()
    memory = quantity(container["resources"]["limits"]["memory"])
    kv = (config.kv_cache_memory_mb or 1024) * 2**20
    if ray_num_gpus(engine) == 0:  # on CPU the KV cache is in the pod's memory, beside the model
        assert kv < memory / 2, overlay
    args = loom_app_args(one(objects, "RayService"))
    for pool in args["pools"]:
        model = pool.get("engine", {}).get("model_path")
        if model:  # a model path must be on a volume the engine pods mount
            mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
            assert any(model.startswith(m.rstrip("/") + "/") for m in mounts), (overlay, model)
