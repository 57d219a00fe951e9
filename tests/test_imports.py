"""What a process loads when it imports a part of Loom: the gateway and the clients never pay for the
engine (torch, the kernels) or for Ray, and the CLI's help is not held up by either."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOOM = str(Path(sys.executable).with_name("loom"))

_PROBE = """
import json, sys
for module in sys.argv[1:]:
    __import__(module)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _top_level_imports(*modules: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "modules",
    [
        ("gateway.server", "gateway.grpc.client"),  # a gateway process, both fronts
        ("protocol.requests", "protocol.model_files", "protocol.adapters", "protocol.engine_config"),
        ("tenancy",),
        ("loom.cli", "loom.cmd_admin", "loom.cmd_generate", "loom.cmd_serve", "loom.cmd_bench"),
    ],
)
def test_no_engine_and_no_ray(modules: tuple[str, ...]) -> None:
    loaded = _top_level_imports(*modules)
    assert not loaded & {"torch", "triton", "ray", "worker", "kernels", "serving", "loadtest"}


def test_a_gateway_started_by_the_serving_layer_loads_no_engine() -> None:
    """`loom serve` and the gateway's Serve replicas start the gateway through serving's bootstrap and
    ingress: Ray, but never torch or the engine."""
    loaded = _top_level_imports("serving.bootstrap", "serving.ingress", "serving.pools", "serving.app")
    assert "ray" in loaded
    assert not loaded & {"torch", "triton", "worker", "kernels"}


def test_the_engine_loads_no_transport() -> None:
    loaded = _top_level_imports("worker.api")
    assert "torch" in loaded  # the probe sees what it should
    assert not loaded & {"ray", "grpc", "fastapi", "uvicorn", "gateway", "tenancy", "serving"}


@pytest.mark.parametrize("argv", [["--help"], ["admin", "--help"], ["generate", "--help"]])
def test_cli_help_loads_nothing_heavy(argv: list[str]) -> None:
    """The help of every command comes without torch or Ray (measured: under 1 s on this machine;
    asserted by what is loaded, not by the clock)."""
    probe = "\n".join(
        [
            "import json, runpy, sys",
            f"sys.argv = ['loom', *{argv!r}]",
            "try:",
            "    runpy.run_module('loom.cli', run_name='__main__')",
            "except SystemExit:",
            "    pass",
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))",
        ]
    )
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "usage: loom" in out.stdout
    assert not loaded & {"torch", "ray", "triton", "grpc", "worker", "kernels"}, time.monotonic() - started
