"""The gateway: one transport-neutral request path (authenticate, validate, admit, tag priority and
salt, dispatch, stream, settle usage; gateway/request_path.py) and the fronts that adapt it (the gRPC
servicer in gateway/grpc/service.py, the OpenAI-compatible HTTP front in gateway/http/)."""
