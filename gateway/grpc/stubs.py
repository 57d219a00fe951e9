"""The generated ``loom.v1`` stubs, imported in one place."""

from __future__ import annotations

try:
    from loomapi.v1 import inference_pb2 as pb
    from loomapi.v1 import inference_pb2_grpc as pb_grpc
except ImportError as exc:  # the stubs are build output
    raise ImportError(
        "the gRPC stubs are missing: run `make install` (or `python proto/generate.py`)"
    ) from exc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "loom.v1.Inference"

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]
