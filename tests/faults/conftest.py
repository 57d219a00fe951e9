"""Fixtures of the fault tests: Ray for this folder, the tiny random model on disk and its greedy
reference. Each test builds what it breaks itself (a deployment, a gateway, a Redis server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.soak_streams import GreedyReference
from loadtest.tiny_model import random_checkpoint, save_hf_dir
from tests.faults.harness import Engines, ray_for_folder


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_dir(random_checkpoint(), tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="package")
def engines(model_dir: Path) -> Iterator[Engines]:
    with ray_for_folder(model_dir) as deployments:
        yield deployments


@pytest.fixture(scope="package")
def reference(model_dir: Path) -> GreedyReference:
    return GreedyReference(model_dir)


@pytest.fixture(scope="package")
def pair(engines: Engines) -> Iterator[Any]:
    """Two replicas of the tiny model, for the faults that do not break a replica."""
    with engines.deploy("faults-pair", replicas=2) as handle:
        yield handle
