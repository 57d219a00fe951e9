"""Pinned calls and their refusal, in a module of their own.

Ray Serve ships the request router's module to each caller by value (cloudpickle), so a class defined
in serving/router.py is, in the gateway's process, a copy distinct from the one the gateway imports:
``isinstance`` against it never matched, and every pinned call was routed by load like any other.
Classes the router must recognise live here, a module shipped by reference.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pinned:
    """The argument of a call that must reach one replica: a subscriber's delta stream there, or an
    abort. A pin to a replica the router no longer lists goes to any replica, which refuses it
    (``ReplicaGoneError``): a routing task left waiting for a replica that is gone would hold one
    of the router's few routing tasks forever, and every other request behind it."""

    replica_id: str
    subscriber: str


class ReplicaGoneError(RuntimeError):
    """A pinned call reached another replica: the one it was pinned to is gone."""
