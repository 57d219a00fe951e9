"""The deployment manifests parse, build the Serve application they name, and set only real settings."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from gateway.settings import GatewaySettings
from tenancy import TenancySettings
from worker.api import EngineConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _build(serve_config: str) -> list:
    apps = yaml.safe_load(serve_config)["applications"]
    built = []
    for app in apps:
        module, attr = app["import_path"].split(":")
        builder = getattr(importlib.import_module(module), attr)
        built.append(builder(app.get("args", {})))
    return built


def test_every_manifest_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 8
    for f in files:
        assert _docs(f), f


def test_rayservice_import_path_builds_the_application() -> None:
    (service,) = [d for d in _docs(DEPLOY / "base" / "rayservice.yaml") if d["kind"] == "RayService"]
    apps = _build(service["spec"]["serveConfigV2"])
    assert len(apps) == 1 and type(apps[0]).__name__ == "Application"


def test_gpu_overlay_serve_config_builds() -> None:
    overlay = yaml.safe_load((DEPLOY / "overlays" / "gpu" / "kustomization.yaml").read_text())
    ops = [op for p in overlay["patches"] for op in yaml.safe_load(p["patch"])]
    (config,) = [op["value"] for op in ops if op["path"] == "/spec/serveConfigV2"]
    assert _build(config)


def test_environment_variables_name_existing_settings() -> None:
    (env,) = [d for d in _docs(DEPLOY / "base" / "rayservice.yaml") if d["kind"] == "ConfigMap"]
    known = {
        "LOOM_GATEWAY_": set(GatewaySettings.model_fields),
        "LOOM_TENANCY_": set(TenancySettings.model_fields),
        "LOOM_ENGINE_": set(EngineConfig.model_fields),
    }
    for name in env["data"]:
        prefix = next(p for p in known if name.startswith(p))
        assert name.removeprefix(prefix).lower() in known[prefix], name
