"""What the rendered manifests tell each pod: its environment, its Ray start parameters, its Serve config.

The tests read the manifests through these helpers to hold them to the code (ports, settings, resources),
and ``deploy.multinode`` reads the very same values to start a local Ray cluster the way KubeRay would,
so both look at one interpretation of the YAML.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.kustomize import Manifest, render

ROOT = Path(__file__).resolve().parent
KUBERNETES = ROOT / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
RAY_CONTAINER = 0  # KubeRay's convention: the Ray container is the first of a group's pod template


def render_overlay(name: str) -> list[Manifest]:
    return render(KUBERNETES / "overlays" / name)


def find(objects: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    (found,) = find(objects, kind, name)
    return found


@dataclass(frozen=True)
class PodTemplate:
    """One kind of pod the manifests create: a workload's template or a RayCluster group's."""

    owner: str  # "StatefulSet/redis", "RayService/loom:head", "RayService/loom:engine"
    group: str | None  # the RayCluster group ("head", "engine", ...), None outside Ray
    template: Manifest  # the PodTemplateSpec
    ray_group: Manifest | None  # the headGroupSpec / workerGroupSpec

    @property
    def spec(self) -> Manifest:
        return self.template["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.template.get("metadata", {}).get("labels", {})

    @property
    def containers(self) -> list[Manifest]:
        return self.spec["containers"]


def pod_templates(objects: list[Manifest]) -> Iterator[PodTemplate]:
    for obj in objects:
        ref = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield PodTemplate(ref, None, obj["spec"]["template"], None)
        elif obj["kind"] == "RayService":
            for group, spec in ray_groups(obj).items():
                yield PodTemplate(f"{ref}:{group}", group, spec["template"], spec)


def ray_groups(ray_service: Manifest) -> dict[str, Manifest]:
    """``{"head": headGroupSpec, "<groupName>": workerGroupSpec, ...}``."""
    cluster = ray_service["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])})
    return groups


def serve_config(ray_service: Manifest) -> Manifest:
    return yaml.safe_load(ray_service["spec"]["serveConfigV2"])


def loom_app_args(ray_service: Manifest) -> Manifest:
    """The ``args`` of the application whose import path is Loom's builder."""
    (app,) = [
        a for a in serve_config(ray_service)["applications"] if a["import_path"] == "serving.app:build_app"
    ]
    return app.get("args", {})


# ---- quantities and Ray start parameters ---------------------------------------------------------

_SUFFIX = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("500m", "2", "4Gi") as a number."""
    text = str(value)
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = float(match.group(1)), match.group(2)
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    return number * _SUFFIX[suffix]


def ray_start_params(group: Manifest) -> dict[str, str]:
    return {k: str(v) for k, v in group.get("rayStartParams", {}).items()}


def ray_custom_resources(group: Manifest) -> dict[str, float]:
    """The ``resources`` start parameter (KubeRay strips the quoting around the JSON, as here)."""
    text = ray_start_params(group).get("resources")
    if not text:
        return {}
    return {k: float(v) for k, v in json.loads(text.strip("'\"` ").replace('\\"', '"')).items()}


def ray_num_cpus(group: Manifest) -> int:
    """What KubeRay passes as ``--num-cpus``: the parameter, else the CPU limit, else the request."""
    params = ray_start_params(group)
    if "num-cpus" in params:
        return int(params["num-cpus"])
    resources = group["template"]["spec"]["containers"][RAY_CONTAINER].get("resources", {})
    for kind in ("limits", "requests"):
        cpu = resources.get(kind, {}).get("cpu")
        if cpu is not None:
            return math.ceil(quantity(cpu))
    raise ValueError("no CPU count for the group")


def ray_num_gpus(group: Manifest) -> int:
    params = ray_start_params(group)
    if "num-gpus" in params:
        return int(params["num-gpus"])
    limits = group["template"]["spec"]["containers"][RAY_CONTAINER].get("resources", {}).get("limits", {})
    return int(quantity(limits.get("nvidia.com/gpu", 0)))


# ---- a container's environment -------------------------------------------------------------------

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, defined: Mapping[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: defined names are replaced, ``$$`` is a literal ``$``,
    undefined references stay as written."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return defined.get(name, match.group(0))

    return _REFERENCE.sub(sub, value)


def container_env(
    container: Manifest, objects: list[Manifest], secrets: Mapping[tuple[str, str], str]
) -> dict[str, str]:
    """The environment the kubelet gives ``container``: ConfigMaps and Secrets (``secrets`` maps
    (Secret name, key) to the value to use) from ``envFrom``, then ``env`` in order with expansion.
    A Secret or ConfigMap that is referenced but missing raises KeyError, as the pod would not start."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            cm = one(objects, "ConfigMap", source["configMapRef"]["name"])
            env.update({source.get("prefix", "") + k: str(v) for k, v in cm.get("data", {}).items()})
        elif "secretRef" in source:
            name = source["secretRef"]["name"]
            env.update({source.get("prefix", "") + k: v for (s, k), v in secrets.items() if s == name})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = str(one(objects, "ConfigMap", ref["name"])["data"][ref["key"]])
        else:
            env[var["name"]] = f"<{json.dumps(var.get('valueFrom'))}>"
    return env


def secret_refs(container: Manifest) -> set[tuple[str, str]]:
    """Every (Secret, key) the container's environment reads."""
    return {
        (v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
        for v in container.get("env", [])
        if "secretKeyRef" in v.get("valueFrom", {})
    }


def any_value_secrets(objects: list[Manifest], value: Any = "x") -> dict[tuple[str, str], str]:
    """A stand-in value for every Secret key any container reads (for reading environments offline)."""
    return {
        ref: f"{value}-{ref[0]}-{ref[1]}"
        for pod in pod_templates(objects)
        for container in pod.containers
        for ref in secret_refs(container)
    }
