"""``loom.v1.Inference`` over gRPC: a thin adapter over the request path, beside the HTTP front.

* ``stubs``: the generated protobuf modules, imported in one place;
* ``auth``: the interceptor that authenticates a call before its body is decoded;
* ``service``: the servicer, translating messages to the neutral request and deltas back;
* ``status``: a refusal as a gRPC status with rich, bounded details;
* ``server``: the grpc.aio server with health and reflection; ``client``: a small asyncio client.
"""
