"""Locked down by default: what every overlay's rendered manifests promise, checked on the objects.

Non-root pods with read-only root filesystems and bounded resources; Redis behind a password from a
Secret and reachable only from Loom's Ray pods; Ray's dashboard, GCS and client ports unreachable
from outside the namespace; the gateway serving TLS from a Secret; budgets, Services and the
ServiceMonitor selecting the pods they are for. NetworkPolicies are evaluated (tests/deploy/netpol.py),
not just read: each case asks whether a given peer may connect to a given pod and port.
"""

from __future__ import annotations

import os
import re
from pathlib import PurePosixPath
from unittest import mock

import pytest
import redis

from deploy.kustomize import load_yaml_documents
from deploy.manifests import (
    KUBERNETES,
    Manifest,
    PodTemplate,
    any_value_secrets,
    container_env,
    find,
    one,
    pod_templates,
    quantity,
)
from gateway.settings import GatewaySettings
from tenancy import TenancySettings

from .netpol import Pod, Source, allowed, selects

RAY_COMPONENTS = {"ray-head", "engine", "gateway"}


def _all_containers(pod: PodTemplate) -> list[Manifest]:
    return [*pod.spec.get("initContainers", []), *pod.containers]


def _effective(pod: PodTemplate, container: Manifest, key: str) -> object:
    """A securityContext field as the kubelet applies it: the container's, else the pod's."""
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.spec.get("securityContext", {}).get(key)


def test_every_container_runs_non_root_read_only_and_bounded(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        pods = list(pod_templates(objects))
        assert {p.labels.get("app.kubernetes.io/component") for p in pods} == RAY_COMPONENTS | {"redis"}
        for pod in pods:
            assert pod.spec.get("securityContext", {}).get("seccompProfile") == {"type": "RuntimeDefault"}
            for c in _all_containers(pod):
                where = (overlay, pod.owner, c["name"])
                assert _effective(pod, c, "runAsNonRoot") is True, where
                assert _effective(pod, c, "runAsUser") not in (0, None), where
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, where
                assert sc["readOnlyRootFilesystem"] is True, where
                assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], where
                _assert_bounded(c.get("resources", {}), where)
        autoscaler = one(objects, "RayService")["spec"]["rayClusterConfig"]["autoscalerOptions"]
        sc = autoscaler["securityContext"]
        assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["readOnlyRootFilesystem"]
        _assert_bounded(autoscaler["resources"], (overlay, "autoscaler"))


def _assert_bounded(resources: Manifest, where: object) -> None:
    for kind in ("cpu", "memory"):
        request = quantity(resources["requests"][kind])
        limit = quantity(resources["limits"][kind])
        assert 0 < request <= limit, (where, kind)


def test_read_only_roots_have_their_scratch_volumes(rendered: dict[str, list[Manifest]]) -> None:
    """Ray writes its session under /tmp/ray and the image puts its caches under /tmp; Redis writes
    /data. A read-only root must come with a writable volume at each of those."""
    needs = {"redis": "/data", **{c: "/tmp" for c in RAY_COMPONENTS}}
    for overlay, objects in rendered.items():
        claims = {
            t["metadata"]["name"]
            for sts in find(objects, "StatefulSet")
            for t in sts["spec"].get("volumeClaimTemplates", [])
        }
        for pod in pod_templates(objects):
            path = needs[pod.labels["app.kubernetes.io/component"]]
            (mount,) = [m for m in pod.containers[0].get("volumeMounts", []) if m["mountPath"] == path]
            assert not mount.get("readOnly"), (overlay, pod.owner, path)
            volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
            writable = mount["name"] in claims or "emptyDir" in volumes.get(mount["name"], {})
            assert writable, (overlay, pod.owner, path)


def test_redis_wants_its_password_and_loom_brings_it(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        secrets = any_value_secrets(objects)
        sts = one(objects, "StatefulSet", "redis")
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        password_var = re.fullmatch(r"\$\((\w+)\)", args[args.index("--requirepass") + 1]).group(1)
        env = {v["name"]: v for v in container["env"]}
        ref = env[password_var]["valueFrom"]["secretKeyRef"]
        secret = (ref["name"], ref["key"])
        assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == ref  # the probes authenticate
        service = one(objects, "Service", "redis")
        (port,) = service["spec"]["ports"]
        for pod in pod_templates(objects):
            if pod.group is None:
                continue
            env_ = container_env(pod.containers[0], objects, secrets)
            with mock.patch.dict(os.environ, env_, clear=True):
                tenancy = TenancySettings()
            assert tenancy.store == "redis", (overlay, pod.owner)
            url = redis.connection.parse_url(tenancy.redis_dsn)
            assert url["host"] == service["metadata"]["name"] and url["port"] == port["port"]
            if pod.group == "gateway":  # the only pods that talk to Redis and hash keys
                assert url["password"] == secrets[secret], (overlay, pod.owner)
                assert tenancy.secret is not None  # the API-key HMAC secret comes from a Secret too
            else:
                assert "password" not in url and tenancy.secret is None, (overlay, pod.owner)


def _pods(objects: list[Manifest]) -> dict[str, Pod]:
    """component -> the pod it runs as (labels and named ports), in the objects' namespace."""
    out = {}
    for pod in pod_templates(objects):
        ports = {p["name"]: p["containerPort"] for c in pod.containers for p in c.get("ports", [])}
        out[pod.labels["app.kubernetes.io/component"]] = Pod("loom", pod.labels, ports)
    return out


def test_network_policies_allow_what_they_claim_and_nothing_else(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        _assert_policies(overlay, objects)


def _assert_policies(overlay: str, objects: list[Manifest]) -> None:
    policies = find(objects, "NetworkPolicy")
    pods = _pods(objects)
    inside = {c: Source.pod_in("loom", pods[c].labels) for c in pods}
    stranger = Source.pod_in("loom", {"app": "debug-shell"})  # in the namespace, not Loom's
    elsewhere = Source.pod_in("default", pods["gateway"].labels)  # Loom's labels, wrong namespace
    operator = Source.pod_in("kuberay-system")
    prometheus = Source.pod_in("monitoring")

    def ok(dest: str, port: int, src: Source) -> bool:
        return allowed(policies, pods[dest], port, src)

    head, gw = pods["ray-head"].ports, pods["gateway"].ports
    for ray_port in (head["gcs"], head["dashboard"], head["client"], 52365, 8080):
        assert ok("ray-head", ray_port, inside["engine"]) and ok("ray-head", ray_port, inside["gateway"])
        for src in (stranger, elsewhere, prometheus):
            assert not ok("ray-head", ray_port, src), (overlay, ray_port, src)
        assert not ok("engine", ray_port, elsewhere) and not ok("gateway", ray_port, elsewhere)
    assert ok("ray-head", head["dashboard"], operator) and ok("ray-head", head["serve"], operator)
    assert not ok("ray-head", head["gcs"], operator) and not ok("engine", head["dashboard"], operator)
    for port in (gw["grpc"], gw["http"]):
        assert ok("gateway", port, elsewhere) and ok("gateway", port, stranger)
    assert ok("gateway", gw["loom-metrics"], prometheus)
    assert not ok("gateway", gw["loom-metrics"], elsewhere) and not ok("gateway", 8000, elsewhere)
    redis_port = pods["redis"].ports["redis"]
    for component in RAY_COMPONENTS:
        assert ok("redis", redis_port, inside[component]), (overlay, component)
    for src in (stranger, elsewhere, operator, prometheus):
        assert not ok("redis", redis_port, src), (overlay, src)
    # every named port a policy opens exists on every pod it selects
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if isinstance(port.get("port"), str):
                    for pod in pods.values():
                        if selects(policy["spec"]["podSelector"], pod.labels):
                            assert port["port"] in pod.ports, (policy["metadata"]["name"], port)


@pytest.mark.parametrize(
    ("kind", "name", "components"),
    [
        ("Service", "loom-gateway", {"gateway"}),
        ("Service", "redis", {"redis"}),
        ("PodDisruptionBudget", "loom-gateway", {"gateway"}),
        ("PodDisruptionBudget", "loom-engine", {"engine"}),
        ("StatefulSet", "redis", {"redis"}),
    ],
)
def test_selectors_pick_their_pods(
    rendered: dict[str, list[Manifest]], kind: str, name: str, components: set[str]
) -> None:
    for objects in rendered.values():
        obj = one(objects, kind, name)
        selector = obj["spec"]["selector"]
        selector = selector if "matchLabels" in selector else {"matchLabels": selector}
        picked = {c for c, pod in _pods(objects).items() if selects(selector, pod.labels)}
        assert picked == components, (kind, name, picked)


def test_ray_control_plane_is_not_published(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        for service in find(objects, "Service"):
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP", (overlay, service["metadata"])
        cluster = one(objects, "RayService")["spec"]["rayClusterConfig"]
        assert cluster["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
        assert not cluster["headGroupSpec"].get("enableIngress")
        assert cluster["authOptions"] == {"mode": "token"}, overlay  # Ray's own token auth as well


def test_gateway_serves_tls_from_a_secret(rendered: dict[str, list[Manifest]]) -> None:
    example = load_yaml_documents(KUBERNETES / "base" / "secrets.example.yaml")
    examples = {s["metadata"]["name"]: s for s in example}
    for overlay, objects in rendered.items():
        (gateway,) = [p for p in pod_templates(objects) if p.group == "gateway"]
        env = container_env(gateway.containers[0], objects, any_value_secrets(objects))
        with mock.patch.dict(os.environ, env, clear=True):
            settings = GatewaySettings()
        assert settings.tls, overlay
        volumes = {v["name"]: v for v in gateway.spec["volumes"]}
        for path in (settings.tls_cert_file, settings.tls_key_file):
            mount = next(
                m
                for m in gateway.containers[0]["volumeMounts"]
                if PurePosixPath(path).parent == PurePosixPath(m["mountPath"])
            )
            secret = volumes[mount["name"]]["secret"]["secretName"]
            assert PurePosixPath(path).name in ("tls.crt", "tls.key"), path
        certificates = [c for c in find(objects, "Certificate") if c["spec"]["secretName"] == secret]
        if certificates:  # cert-manager issues it: for the Service's names in this namespace
            (cert,) = certificates
            ns = one(objects, "Service", "loom-gateway")["metadata"]["namespace"]
            assert f"loom-gateway.{ns}.svc" in cert["spec"]["dnsNames"], overlay
            issuer = cert["spec"]["issuerRef"]
            assert issuer["kind"] == "ClusterIssuer" or find(objects, "Issuer", issuer["name"]), overlay
        else:  # created by hand, as secrets.example.yaml shows
            assert examples[secret]["type"] == "kubernetes.io/tls", overlay


def test_service_monitor_scrapes_the_gateways(rendered: dict[str, list[Manifest]]) -> None:
    monitored = [o for o, objects in rendered.items() if find(objects, "ServiceMonitor")]
    assert "gpu" in monitored
    for overlay in monitored:
        objects = rendered[overlay]
        monitor = one(objects, "ServiceMonitor")
        selector = monitor["spec"]["selector"]
        services = [s for s in find(objects, "Service") if selects(selector, s["metadata"]["labels"])]
        assert [s["metadata"]["name"] for s in services] == ["loom-gateway"], overlay
        (endpoint,) = monitor["spec"]["endpoints"]
        (port,) = [p for p in services[0]["spec"]["ports"] if p["name"] == endpoint["port"]]
        pods = _pods(objects)
        number = pods["gateway"].ports[port["targetPort"]]  # the Service's metrics port reaches a pod port
        assert allowed(find(objects, "NetworkPolicy"), pods["gateway"], number, Source.pod_in("monitoring"))
        assert endpoint["path"] == "/metrics"
