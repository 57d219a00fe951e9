"""Every rendered object validates against the schema of its kind, and the Serve config builds Loom.

* Kubernetes' own kinds: ``kubernetes-validate`` (the API's OpenAPI schemas, strict: an unknown field
  is an error, as ``kubectl apply`` with server-side strict field validation makes it) at the
  Kubernetes versions in ``KUBERNETES_VERSIONS``.
* The RayService: KubeRay v1.7.0's own CRD schema (deploy/schemas/ray.io_rayservices.yaml), made
  strict the same way, with ``jsonschema``; its ``serveConfigV2`` with Ray Serve's
  ``ServeDeploySchema``; its import path builds the real application with the manifest's args and
  the environment a pod gets.
* Custom resources without a schema here (cert-manager's Issuer and Certificate, the Prometheus
  Operator's ServiceMonitor) are listed in ``NO_SCHEMA`` and checked structurally in test_lockdown.py.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
from typing import Any
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
from ray.serve.schema import ServeDeploySchema

from deploy.kustomize import load_yaml_documents
from deploy.manifests import (
    KUBERNETES,
    ROOT,
    Manifest,
    any_value_secrets,
    container_env,
    one,
    pod_templates,
    secret_refs,
    serve_config,
)

# The oldest and the newest Kubernetes minor the manifests are validated against (kubernetes-validate
# uses the newest schema it ships that is not newer than the version asked for).
KUBERNETES_VERSIONS = ("1.32.0", "1.37.0")
KUBERAY_CRD = ROOT / "schemas" / "ray.io_rayservices.yaml"
NO_SCHEMA = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate")}
NO_SCHEMA |= {("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_objects_validate_strictly(rendered: dict[str, list[Manifest]], version: str) -> None:
    checked = set()
    for overlay, objects in rendered.items():
        for obj in objects:
            kind = (obj["apiVersion"], obj["kind"])
            if obj["kind"] == "RayService" or kind in NO_SCHEMA:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} at {path}: {exc.message}")
            checked.add(obj["kind"])
    core = {"Namespace", "ConfigMap", "Service", "StatefulSet", "NetworkPolicy", "PodDisruptionBudget"}
    assert checked >= core


def test_the_secrets_example_validates() -> None:
    secrets = load_yaml_documents(KUBERNETES / "base" / "secrets.example.yaml")
    assert {s["metadata"]["name"] for s in secrets} == {"loom-tenancy", "loom-redis", "loom-gateway-tls"}
    for secret in secrets:
        kubernetes_validate.validate(secret, KUBERNETES_VERSIONS[0], strict=True)


def test_a_typo_fails_validation(rendered: dict[str, list[Manifest]]) -> None:
    """The strict schemas do catch a misspelt field (so a pass above means something)."""
    sts = copy.deepcopy(one(rendered["cpu-dev"], "StatefulSet", "redis"))
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSIONS[0], strict=True)
    ray = copy.deepcopy(one(rendered["cpu-dev"], "RayService"))
    ray["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError):
        _rayservice_validator().validate(ray)


def _strict(schema: Any) -> Any:
    """Unknown fields become errors wherever the CRD lists an object's properties and does not keep
    unknown fields: what the API server does with strict field validation."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _rayservice_validator() -> jsonschema.Draft7Validator:
    (crd,) = load_yaml_documents(KUBERAY_CRD)
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(v1["schema"]["openAPIV3Schema"])
    # metadata is validated by the API server, not by the CRD: keep what Kubernetes accepts
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def test_rayservice_validates_against_kuberays_crd(rendered: dict[str, list[Manifest]]) -> None:
    validator = _rayservice_validator()
    for overlay, objects in rendered.items():
        ray = one(objects, "RayService")
        errors = sorted(validator.iter_errors(ray), key=lambda e: list(e.path))
        assert not errors, f"{overlay}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5]
        )


def test_serve_config_validates_with_ray_serve(rendered: dict[str, list[Manifest]]) -> None:
    for objects in rendered.values():
        config = ServeDeploySchema.model_validate(serve_config(one(objects, "RayService")))
        assert [a.import_path for a in config.applications] == ["serving.app:build_app"]
        (app,) = config.applications
        assert app.route_prefix is None  # clients reach the gateway's own servers, not Serve's proxy


def pod_environment(objects: list[Manifest], group: str) -> dict[str, str]:
    """The environment of a RayService group's Ray container, with stand-in secret values."""
    (pod,) = [p for p in pod_templates(objects) if p.group == group]
    return container_env(pod.containers[0], objects, any_value_secrets(objects))


def _deployments(app: Any) -> dict[str, Any]:
    """name -> Deployment for every deployment bound into a Serve application."""
    found: dict[str, Any] = {}

    def visit(value: Any) -> None:
        bound = getattr(value, "_bound_deployment", None)
        if bound is not None:
            found[bound.name] = bound
            for arg in (*bound.init_args, *bound.init_kwargs.values()):
                visit(arg)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(app)
    return found


def build_from_manifest(objects: list[Manifest]) -> dict[str, Any]:
    """Build every Serve application of the RayService, as a pod would (its environment and nothing
    else), and return its deployments by name."""
    env = pod_environment(objects, "head")
    built: dict[str, Any] = {}
    with mock.patch.dict(os.environ, env, clear=True):
        for app in serve_config(one(objects, "RayService"))["applications"]:
            module, attr = app["import_path"].split(":")
            builder = getattr(importlib.import_module(module), attr)
            built.update(_deployments(builder(app.get("args", {}))))
    return built


def test_import_path_builds_the_application(rendered: dict[str, list[Manifest]]) -> None:
    for overlay, objects in rendered.items():
        deployments = build_from_manifest(objects)
        assert set(deployments) == {"gateway", "engine-shared"}, overlay
        assert deployments["gateway"].func_or_class.__name__ == "GatewayIngress"
        assert deployments["engine-shared"].func_or_class.__name__ == "EngineReplica"


def test_only_gateway_pods_hold_the_tenancy_and_redis_secrets(rendered: dict[str, list[Manifest]]) -> None:
    """An engine never talks to Redis nor hashes a key: a compromised engine pod must hold neither
    the API-key HMAC secret nor Redis's password (nor the head, which runs no replica)."""
    for overlay, objects in rendered.items():
        for pod in pod_templates(objects):
            if pod.group is None:
                continue
            refs = {name for c in pod.containers for name, _ in secret_refs(c)}
            if pod.group == "gateway":
                assert refs == {"loom-tenancy", "loom-redis"}, overlay
                env = pod_environment(objects, "gateway")
                assert env["LOOM_TENANCY_REDIS_PASSWORD"] and env["LOOM_TENANCY_SECRET"]
            else:
                assert not refs, (overlay, pod.group)
        gateway = build_from_manifest(objects)["gateway"]
        tenancy_args = gateway.init_args[1]  # what Ray keeps in its GCS
        assert tenancy_args["redis_url"] == "redis://redis:6379/0"
        assert not {"secret", "previous_secrets", "redis_password"} & set(tenancy_args)
