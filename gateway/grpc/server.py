"""The grpc.aio server of the gateway: Inference behind the authentication interceptor, the standard
health service and server reflection, with the connection bounds of the gateway's settings."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.grpc.auth import AuthInterceptor
from gateway.grpc.service import InferenceService
from gateway.grpc.stubs import SERVICE_NAME, pb_grpc
from gateway.request_path import RequestPath
from gateway.settings import GatewaySettings

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def build_server(
    path: RequestPath, settings: GatewaySettings, health_servicer: health.aio.HealthServicer
) -> grpc.aio.Server:
    s = settings
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(path.authenticate)],
        maximum_concurrent_rpcs=s.max_concurrent_streams,
        options=[
            ("grpc.so_reuseport", int(s.reuse_port)),
            ("grpc.max_concurrent_streams", s.max_streams_per_connection),
            ("grpc.keepalive_time_ms", int(s.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_connection_idle_ms", int(s.idle_timeout_s * 1000)),
            # No connection outlives its longest allowed stream (plus a grace to finish it).
            ("grpc.max_connection_age_ms", int(s.max_stream_duration_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(s.max_stream_duration_s * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ],
    )
    pb_grpc.add_InferenceServicer_to_server(InferenceService(path), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    return server


async def set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        await servicer.set(service, status)
