"""The overlays render, and deploy/kustomize.py renders them as kustomize does.

The renderer is what every other deployment test reads, so it is held twice: by unit tests of each
transformer on small inputs, and (where kubectl is installed) by rendering every overlay with
``kubectl kustomize`` and requiring the very same objects.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.kustomize import KustomizeError, json6902, json_merge_patch, render, strategic_merge
from deploy.manifests import KUBERNETES, OVERLAYS, Manifest


def _key(obj: Manifest) -> tuple[str, str | None, str]:
    return obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]


def test_every_overlay_renders_namespaced_and_labelled(rendered: dict[str, list[Manifest]]) -> None:
    assert set(OVERLAYS) >= {"cpu-dev", "gpu"}
    for name, objects in rendered.items():
        kinds = {o["kind"] for o in objects}
        assert {"RayService", "StatefulSet", "NetworkPolicy", "PodDisruptionBudget", "Service"} <= kinds
        for obj in objects:
            assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "loom", (name, _key(obj))
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == "loom", (name, _key(obj))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_same_objects_as_kubectl_kustomize(overlay: str, rendered: dict[str, list[Manifest]]) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    theirs = {_key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {_key(o): o for o in rendered[overlay]}
    assert set(ours) == set(theirs)
    for key, obj in ours.items():
        assert obj == theirs[key], key


def _kustomization(tmp: Path, text: str, files: dict[str, str]) -> Path:
    (tmp / "kustomization.yaml").write_text(text)
    for name, body in files.items():
        (tmp / name).write_text(body)
    return tmp


_DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      containers:
        - {name: app, image: "registry.example/app:1.0", env: [{name: A, value: "1"}]}
        - {name: side, image: busybox}
"""


def test_strategic_merge_merges_containers_and_env_by_name(tmp_path: Path) -> None:
    patch = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      containers:
        - {name: app, env: [{name: B, value: "2"}, {name: A, value: "3"}]}
"""
    kdir = _kustomization(
        tmp_path,
        "resources: [d.yaml]\npatches: [{path: p.yaml}]\nnamespace: ns\n"
        "images: [{name: registry.example/app, newTag: '2.0'}]\n",
        {"d.yaml": _DEPLOYMENT, "p.yaml": patch},
    )
    (web,) = render(kdir)
    app, side = web["spec"]["template"]["spec"]["containers"]
    assert app["env"] == [{"name": "A", "value": "3"}, {"name": "B", "value": "2"}]
    assert app["image"] == "registry.example/app:2.0" and side["image"] == "busybox"
    assert web["metadata"]["namespace"] == "ns"


def test_custom_resources_get_json_merge_patches_lists_replaced() -> None:
    target = {"spec": {"groups": [{"name": "a", "n": 1}, {"name": "b"}], "keep": 1}}
    merged = json_merge_patch(target, {"spec": {"groups": [{"name": "a", "n": 2}], "keep": None}})
    assert merged == {"spec": {"groups": [{"name": "a", "n": 2}]}}
    # the same patch on a built-in kind's containers would merge by name instead
    containers = {"containers": [{"name": "a"}, {"name": "b"}]}
    merged = strategic_merge(containers, {"containers": [{"name": "a", "x": 1}]})
    assert merged == {"containers": [{"name": "a", "x": 1}, {"name": "b"}]}


def test_json6902_ops() -> None:
    doc = {"a": {"b/c": [1, 2]}, "d": 1}
    out = json6902(
        doc,
        [
            {"op": "add", "path": "/a/b~1c/-", "value": 3},
            {"op": "add", "path": "/a/b~1c/0", "value": 0},
            {"op": "replace", "path": "/d", "value": 2},
            {"op": "copy", "from": "/d", "path": "/e"},
            {"op": "move", "from": "/e", "path": "/f"},
            {"op": "remove", "path": "/a/b~1c/1"},
            {"op": "test", "path": "/f", "value": 2},
        ],
    )
    assert out == {"a": {"b/c": [0, 2, 3]}, "d": 2, "f": 2}
    assert doc == {"a": {"b/c": [1, 2]}, "d": 1}  # the input is untouched
    with pytest.raises(KustomizeError):
        json6902(doc, [{"op": "replace", "path": "/missing", "value": 1}])
    with pytest.raises(KustomizeError):
        json6902(doc, [{"op": "test", "path": "/d", "value": 5}])


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [d.yaml]\nconfigMapGenerator: [{name: x, literals: [a=b]}]\n",
        "resources: [d.yaml]\ncommonLabels: {a: b}\n",
        "resources: [d.yaml]\nlabels: [{pairs: {a: b}, includeSelectors: true}]\n",
        "resources: [d.yaml]\npatches: [{target: {kind: Deployment, labelSelector: a=b}, patch: '[]'}]\n",
        "resources: [d.yaml]\npatches: [{target: {kind: Service}, patch: '[]'}]\n",
        "resources: [d.yaml, d.yaml]\n",
        "resources: [https://example.invalid/x.yaml]\n",
    ],
)
def test_refuses_what_it_does_not_implement(tmp_path: Path, kustomization: str) -> None:
    kdir = _kustomization(tmp_path, kustomization, {"d.yaml": _DEPLOYMENT})
    with pytest.raises(KustomizeError):
        render(kdir)


def test_strategic_merge_directives_are_refused(tmp_path: Path) -> None:
    patch = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec: {$patch: replace}\n"
    kdir = _kustomization(
        tmp_path, "resources: [d.yaml]\npatches: [{path: p.yaml}]\n", {"d.yaml": _DEPLOYMENT, "p.yaml": patch}
    )
    with pytest.raises(KustomizeError):
        render(kdir)
