"""The server the fuzz tests hit: the real gateway (gRPC and the OpenAI-compatible HTTP front) over a
loopback socket, a Ray Serve replica of the tiny random model, tenants in the real Redis.

It is the shape of tests/gateway's shared ``gateway`` fixture, built for this folder (pytest cannot
share that session fixture with a sibling folder without starting a second Ray; see
tests/faults/harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.server import GatewayServer
from loadtest.soak_fuzz import Target
from loadtest.tiny_model import random_checkpoint, save_hf_dir
from tests.faults.harness import Engines, Tenants, delete_prefix, ray_for_folder, tenancy_settings
from tests.gateway.conftest import private_gateway

PATIENCE_S = 1.0


@dataclass
class Fuzzed:
    """The server under fuzz, and a target (address, working key, model) for the case generator."""

    server: GatewayServer
    target: Target


@pytest.fixture(scope="package")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    model_dir = save_hf_dir(random_checkpoint(), tmp_path_factory.mktemp("models") / "tiny")
    with ray_for_folder(model_dir) as deployments:
        yield deployments


@pytest.fixture(scope="package")
async def fuzzed(engines: Engines, redis_url: str) -> AsyncIterator[Fuzzed]:
    settings = tenancy_settings(redis_url)
    try:
        with engines.deploy("fuzz-tiny") as handle:
            # Short patience for slow clients, so that half-sent requests are judged in seconds.
            patience = {"http_header_timeout_s": PATIENCE_S, "http_body_timeout_s": PATIENCE_S}
            async with private_gateway(handle, settings, Path(engines.model_dir), **patience) as server:
                tenants = Tenants(settings, server.tenancy)
                _, key = await tenants.create()
                _, limited = await tenants.create(quotas={"max_concurrent": 2, "requests_per_minute": 120})
                assert server.http_address is not None
                target = Target(server.address, server.http_address, key, "tiny", limited, PATIENCE_S)
                yield Fuzzed(server, target)
    finally:
        delete_prefix(settings)
