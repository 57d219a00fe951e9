"""Rendered overlays, shared by the deployment tests (rendering is cheap, but done once per session)."""

from __future__ import annotations

import pytest

from deploy.kustomize import Manifest
from deploy.manifests import OVERLAYS, render_overlay


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Manifest]]:
    """``{overlay name: its rendered objects}`` for every overlay under deploy/kubernetes/overlays."""
    assert OVERLAYS, "no overlays found"
    return {name: render_overlay(name) for name in OVERLAYS}
