"""Generate the Python gRPC stubs for proto/ into the ``loomapi`` package at the repository root.

Run by ``make install`` (and by the test harness when the stubs are missing or older than the
.proto files). The stubs are build output: ignored by git, regenerated from the contract.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT


def stale() -> bool:
    protos = list(PROTO_DIR.rglob("*.proto"))
    for proto in protos:
        stub = OUT_DIR / proto.relative_to(PROTO_DIR).with_name(proto.stem + "_pb2.py")
        if not stub.exists() or stub.stat().st_mtime < proto.stat().st_mtime:
            return True
    return False


def generate() -> None:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf well-known types
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Make every generated folder a regular package, so setuptools and mypy find it.
    for proto in protos:
        folder = OUT_DIR / Path(proto).parent
        while folder != OUT_DIR:
            (folder / "__init__.py").touch()
            folder = folder.parent


if __name__ == "__main__":
    if "--if-stale" not in sys.argv or stale():
        generate()
        print(f"generated stubs for {', '.join(p.name for p in PROTO_DIR.rglob('*.proto'))} into loomapi/")
