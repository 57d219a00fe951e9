"""Render a kustomize overlay in Python: the subset of kustomize that ``deploy/kubernetes`` uses.

Why not kustomize itself: it is a Go binary, and no registry this project installs from (PyPI, npm,
Debian) ships it, so ``make test`` could not count on it. What is here is small and refuses everything
it does not implement (an unknown kustomization field, a ``$patch`` directive, a label selector in a
patch target), so an overlay never renders silently wrong. Where ``kubectl`` is installed, the tests
also render every overlay with ``kubectl kustomize`` and require the same objects.

Supported, with kustomize's semantics:

* ``resources``: files (multi-document YAML) and directories holding a ``kustomization.yaml``;
* ``components``: directories whose kustomization has ``kind: Component``, applied in order onto the
  resources accumulated so far;
* ``patches``: inline (``patch``) or from a file (``path``), with a ``target`` (kind, name, namespace,
  group, version) or aimed by the patch's own kind and name; a list is a JSON 6902 patch (add, remove,
  replace, test, move, copy), a mapping a strategic-merge patch (merge keys of the built-in kinds
  used here; custom resources get a JSON merge patch, as kustomize gives them);
* ``namespace``; ``labels`` (``pairs``, ``includeSelectors: false``, optionally
  ``includeTemplates`` for workload pod templates); ``images`` (``newName``, ``newTag``, ``digest``,
  on every ``containers``/``initContainers`` list, custom resources included, as kustomize does).

Transformers run in kustomize's order: patches, namespace, labels, images.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]

_KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "patches",
    "namespace",
    "labels",
    "images",
}
# Built-in API groups (strategic merge applies); everything else is a custom resource.
_BUILTIN_GROUPS = {
    "",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
    "scheduling.k8s.io",
}
_CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "ClusterIssuer",
}
# Strategic-merge keys of the built-in list fields these manifests use (from the Kubernetes API's
# x-kubernetes-patch-merge-key); any other list is replaced whole.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}
_WORKLOAD_TEMPLATES = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    """The kustomization asks for something this renderer does not implement (or is wrong)."""


def load_yaml_documents(path: Path) -> list[Manifest]:
    """Every non-empty document of a YAML file (C loader when available: the CRD is 1 MB)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with path.open() as f:
        return [d for d in yaml.load_all(f, Loader=loader) if d]


def render(directory: Path | str) -> list[Manifest]:
    """The objects ``kustomize build DIRECTORY`` would print (as parsed YAML, in resource order)."""
    directory = Path(directory)
    kustomization = _read_kustomization(directory)
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{directory}: a {kustomization['kind']} cannot be built on its own")
    return _build(directory, kustomization, [])


def _read_kustomization(directory: Path) -> Manifest:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        path = directory / name
        if path.is_file():
            (doc,) = load_yaml_documents(path)
            unknown = set(doc) - _KUSTOMIZATION_FIELDS
            if unknown:
                raise KustomizeError(f"{path}: fields not implemented here: {sorted(unknown)}")
            return doc
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def _build(directory: Path, k: Manifest, accumulated: list[Manifest]) -> list[Manifest]:
    """Resources of ``k`` added to ``accumulated``, then components, then ``k``'s transformers."""
    objects = list(accumulated)
    for entry in k.get("resources", []):
        if "://" in entry or entry.startswith("github.com/"):
            raise KustomizeError(f"{directory}: remote resource {entry!r} is not supported")
        path = (directory / entry).resolve()
        if path.is_dir():
            sub = _read_kustomization(path)
            if sub.get("kind", "Kustomization") == "Component":
                raise KustomizeError(f"{path}: a Component belongs under components:, not resources:")
            objects += _build(path, sub, [])
        else:
            objects += load_yaml_documents(path)
    for entry in k.get("components", []):
        path = (directory / entry).resolve()
        comp = _read_kustomization(path)
        if comp.get("kind") != "Component":
            raise KustomizeError(f"{path}: listed under components: but is not a Component")
        objects = _build(path, comp, objects)
    _check_unique(objects, directory)
    for patch in k.get("patches", []):
        _apply_patch(directory, patch, objects)
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in _CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    for label in k.get("labels", []):
        _apply_labels(directory, label, objects)
    for image in k.get("images", []):
        for obj in objects:
            _set_images(obj, image)
    return objects


def _check_unique(objects: list[Manifest], directory: Path) -> None:
    seen: set[tuple[str, str, str | None]] = set()
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace"))
        if key in seen:
            raise KustomizeError(f"{directory}: {key} is defined twice")
        seen.add(key)


# ---- patches -------------------------------------------------------------------------------------


def _group_version(obj: Manifest) -> tuple[str, str]:
    group, _, version = obj["apiVersion"].rpartition("/")
    return group, version


def _matches(obj: Manifest, target: Manifest) -> bool:
    unknown = set(target) - {"kind", "name", "namespace", "group", "version"}
    if unknown:
        raise KustomizeError(f"patch target fields not implemented here: {sorted(unknown)}")
    group, version = _group_version(obj)
    meta = obj.get("metadata", {})
    return (
        target.get("kind", obj["kind"]) == obj["kind"]
        and re.fullmatch(target.get("name", ".*"), meta.get("name", "")) is not None
        and target.get("namespace", meta.get("namespace")) == meta.get("namespace")
        and target.get("group", group) == group
        and target.get("version", version) == version
    )


def _apply_patch(directory: Path, spec: Manifest, objects: list[Manifest]) -> None:
    unknown = set(spec) - {"patch", "path", "target"}
    if unknown:
        raise KustomizeError(f"{directory}: patch fields not implemented here: {sorted(unknown)}")
    if ("patch" in spec) == ("path" in spec):
        raise KustomizeError(f"{directory}: a patch needs exactly one of patch: and path:")
    text = spec["patch"] if "patch" in spec else (directory / spec["path"]).read_text()
    body = yaml.safe_load(text)
    target = spec.get("target")
    if target is None:
        if not isinstance(body, dict):
            raise KustomizeError(f"{directory}: a JSON 6902 patch needs a target")
        target = {"kind": body["kind"], "name": re.escape(body["metadata"]["name"])}
    hits = [obj for obj in objects if _matches(obj, target)]
    if not hits:
        raise KustomizeError(f"{directory}: patch target {target} matches nothing")
    for obj in hits:
        if isinstance(body, list):
            patched = json6902(obj, body)
        else:
            group, _ = _group_version(obj)
            patched = strategic_merge(obj, body) if group in _BUILTIN_GROUPS else json_merge_patch(obj, body)
        obj.clear()
        obj.update(patched)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def json6902(document: Manifest, ops: list[Manifest]) -> Manifest:
    """RFC 6902 on a copy of ``document``."""
    doc = copy.deepcopy(document)
    for op in ops:
        parts = _pointer(op["path"])
        parent, last = _walk(doc, parts[:-1]), parts[-1] if parts else None
        kind = op["op"]
        if last is None:
            raise KustomizeError("patching the whole document is not supported")
        try:
            if kind in ("add", "replace", "move", "copy"):
                if kind in ("move", "copy"):
                    src = _pointer(op["from"])
                    value = copy.deepcopy(_walk(doc, src))
                    if kind == "move":
                        _remove(_walk(doc, src[:-1]), src[-1])
                        parent = _walk(doc, parts[:-1])
                else:
                    value = copy.deepcopy(op["value"])
                if isinstance(parent, list):
                    index = len(parent) if last == "-" else int(last)
                    if kind == "replace":
                        parent[index] = value
                    else:
                        parent.insert(index, value)
                else:
                    if kind == "replace" and last not in parent:
                        raise KeyError(last)
                    parent[last] = value
            elif kind == "remove":
                _remove(parent, last)
            elif kind == "test":
                if _walk(doc, parts) != op["value"]:
                    raise KustomizeError(f"test failed at {op['path']}")
            else:
                raise KustomizeError(f"unknown JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise KustomizeError(f"JSON patch {op} does not apply: {exc!r}") from None
    return doc


def _remove(parent: Any, key: str) -> None:
    if isinstance(parent, list):
        del parent[int(key)]
    else:
        del parent[key]


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: mappings merge, ``null`` deletes, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = json_merge_patch(out.get(key), value)
    return out


def strategic_merge(target: Any, patch: Any, field: str | None = None) -> Any:
    """Kubernetes' strategic merge for the list fields in ``_MERGE_KEYS``; no ``$patch`` directives."""
    if isinstance(patch, dict):
        if any(str(k).startswith("$") for k in patch):
            raise KustomizeError(f"strategic-merge directives are not implemented: {sorted(patch)}")
        out = copy.deepcopy(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out.get(key), value, key)
        return out
    if isinstance(patch, list) and field in _MERGE_KEYS and isinstance(target, list):
        key = _MERGE_KEYS[field]
        out = copy.deepcopy(target)
        for item in patch:
            match = next((i for i, t in enumerate(out) if t.get(key) == item.get(key)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = strategic_merge(out[match], item)
        return out
    return copy.deepcopy(patch)


# ---- labels and images ---------------------------------------------------------------------------


def _apply_labels(directory: Path, spec: Manifest, objects: list[Manifest]) -> None:
    unknown = set(spec) - {"pairs", "includeSelectors", "includeTemplates"}
    if unknown or spec.get("includeSelectors"):
        raise KustomizeError(
            f"{directory}: labels: only pairs, includeSelectors: false and includeTemplates are "
            f"implemented (got {sorted(spec)})"
        )
    pairs = {str(k): str(v) for k, v in spec["pairs"].items()}
    for obj in objects:
        obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if spec.get("includeTemplates") and obj["kind"] in _WORKLOAD_TEMPLATES:
            template = obj["spec"]["template"].setdefault("metadata", {})
            template.setdefault("labels", {}).update(pairs)


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    name, _, digest = image.partition("@")
    tag = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _image_matches(image: str, name: str) -> bool:
    """kustomize's rule: the name, then optionally a digest and/or a tag."""
    pattern = "^" + re.escape(name) + r"(@sha256)?(:[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127})?$"
    return re.match(pattern, image) is not None


def _set_images(obj: Any, spec: Manifest) -> None:
    unknown = set(spec) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise KustomizeError(f"images: fields not implemented here: {sorted(unknown)}")
    for container in _containers(obj):
        image = container.get("image")
        if not isinstance(image, str) or not _image_matches(image, spec["name"]):
            continue
        name, tag, digest = _split_image(image)
        name = spec.get("newName", name)
        if "newTag" in spec:
            tag, digest = str(spec["newTag"]), None
        if "digest" in spec:
            tag, digest = None, spec["digest"]
        container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _containers(node: Any) -> Iterable[Manifest]:
    """Every item of every ``containers``/``initContainers`` list, wherever it sits."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)
