"""Every LOOM_* environment variable is read by exactly one settings class, and nothing else reads it."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "protocol", "kernels", "worker", "tenancy", "gateway", "serving", "loom", "loadtest")

# Product code that touches os.environ for a reason other than reading Loom's settings.
ENVIRON_ALLOWED = {
    "kernels/bench/run.py": "a GPU script: its --out default ($OUT) and setting TRITON_INTERPRET",
    "serving/bootstrap.py": "sets Ray's RAY_DEDUP_LOGS for the local cluster it starts",
    "gateway/http/decoder.py": "the environment of the decoder process it starts: this one's, PYTHONPATH "
    "this one's import path",
    "loom/cmd_bench.py": "the environment of the benchmarks it launches: this one's, PYTHONPATH the checkout",
    "loadtest/bench_admission.py": "the benchmark's --redis-url default from REDIS_URL, as the tests",
    "loadtest/workload.py": "a workload file may name the variable that holds a tenant's key",
    "loadtest/soak_server.py": "the environment of the loom serve it starts: this one's plus its settings",
    "loadtest/bench_guidellm.py": "the environment of each guidellm process: this one's, offline",
    "loadtest/peer_vllm.py": "the environment of the vLLM subprocess: this one's plus vLLM's CPU variables",
    "loadtest/aba_checkouts.py": "the environment of each checkout's run: this one's, its PYTHONPATH and "
    "torch extensions folder",
    "loadtest/peer_vllm_runner.py": "runs inside the peer venv and records the vLLM variables it ran under",
}


def _is_os(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _environ_uses(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, variable name when a constant) for each use of os.environ or os.getenv."""
    uses: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if _is_os(node, "environ") or _is_os(node, "getenv"):
            uses.append((node.lineno, None))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            direct = _is_os(func, "getenv")
            via_environ = isinstance(func, ast.Attribute) and _is_os(func.value, "environ")
            if (direct or via_environ) and isinstance(node.args[0].value, str):
                uses.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Subscript) and _is_os(node.value, "environ"):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                uses.append((node.lineno, key.value))
    return uses


def test_no_module_reads_loom_variables_itself() -> None:
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            uses = _environ_uses(ast.parse(path.read_text(), rel))
            loom_vars = [(line, name) for line, name in uses if name and name.startswith("LOOM_")]
            if loom_vars or (uses and rel not in ENVIRON_ALLOWED):
                offenders.append((rel, [line for line, _ in uses]))
    assert offenders == [], f"read the environment through a settings class instead: {offenders}"


def _settings_classes() -> list[type[BaseSettings]]:
    for pkg in PACKAGES:
        for info in pkgutil.walk_packages([str(ROOT / pkg)], prefix=f"{pkg}."):
            if ".bench." in info.name or info.name.endswith((".bench", "__main__")):
                continue
            importlib.import_module(info.name)
    found: list[type[BaseSettings]] = []
    todo = [BaseSettings]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.split(".")[0] in PACKAGES:
                found.append(sub)
    return found


def test_each_variable_has_one_settings_class() -> None:
    owners: dict[str, list[str]] = {}
    for cls in _settings_classes():
        prefix = cls.model_config.get("env_prefix", "")
        for name, field in cls.model_fields.items():
            env = (field.validation_alias if isinstance(field.validation_alias, str) else None) or (
                prefix + name
            )
            owners.setdefault(env.upper(), []).append(f"{cls.__module__}.{cls.__qualname__}")
    shared = {env: who for env, who in owners.items() if len(who) > 1}
    assert shared == {}
    expected = {"LOOM_ENGINE_MAX_NUM_SEQS", "LOOM_GATEWAY_PORT", "LOOM_API_KEY", "LOOM_FORCE_TRITON"}
    assert expected <= set(owners)
