"""Kubernetes NetworkPolicy ingress semantics, evaluated offline on rendered manifests.

Enough of the API's rules to answer "may a pod with these labels in that namespace open a TCP
connection to this pod on this port?": policies select pods by label selector (matchLabels and
matchExpressions); a pod selected by no Ingress policy accepts everything; a selected pod accepts a
connection that any rule of any selecting policy allows; a rule's peers are a podSelector (this
namespace), a namespaceSelector (all pods there) or both (those pods in those namespaces); ports match
by number or by the destination container's port name (with endPort ranges). ipBlock peers are
treated as matching no pod.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Manifest = dict[str, Any]


def selects(selector: Manifest | None, labels: dict[str, str]) -> bool:
    """A LabelSelector; an empty one selects everything."""
    selector = selector or {}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op}")
    return True


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> number


@dataclass(frozen=True)
class Source:
    namespace: str
    namespace_labels: dict[str, str]
    labels: dict[str, str]

    @classmethod
    def pod_in(cls, namespace: str, labels: dict[str, str] | None = None) -> Source:
        return cls(namespace, {"kubernetes.io/metadata.name": namespace}, labels or {})


def _port_matches(rule_port: Manifest, dest: Pod, port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):
        return dest.ports.get(wanted) == port
    return wanted <= port <= rule_port.get("endPort", wanted)


def _peer_matches(peer: Manifest, policy_ns: str, src: Source) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], src.labels)


def allowed(policies: list[Manifest], dest: Pod, port: int, src: Source) -> bool:
    applying = [
        p
        for p in policies
        if p["metadata"].get("namespace") == dest.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], dest.labels)
    ]
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            ports = rule.get("ports")
            peer_ok = not peers or any(
                _peer_matches(peer, policy["metadata"]["namespace"], src) for peer in peers
            )
            port_ok = not ports or any(_port_matches(p, dest, port) for p in ports)
            if peer_ok and port_ok:
                return True
    return False
