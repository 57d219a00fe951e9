"""Gateway settings (``LOOM_GATEWAY_*``) and its clients' (``LOOM_API_KEY``, ``LOOM_ADDRESS``), from the
environment or constructor arguments; nothing else in Loom reads these variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="gRPC; 0 picks a free port")
    http_port: int | None = Field(
        8000, ge=0, le=65535, description="the OpenAI-compatible HTTP front; None disables it"
    )
    http_keepalive_s: float = Field(
        5.0, gt=0, description="idle HTTP keep-alive connections close after this"
    )
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(9464, ge=0, le=65535, description="None disables the metrics endpoint")
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = Field(None, description="set to require client certificates (mTLS)")
    drain_grace_s: float = Field(30.0, ge=0)
    default_max_tokens: int = Field(256, ge=1)
    max_concurrent_streams: int = Field(4096, ge=1)
    log_prompts: bool = Field(False, description="log prompt text (off: only sizes and ids are logged)")


class ClientSettings(BaseSettings):
    """What ``loom generate`` (and other clients) use to reach a gateway."""

    model_config = SettingsConfigDict(env_prefix="LOOM_", extra="ignore")

    api_key: str | None = Field(None, description="a tenant's API key")
    address: str = Field("127.0.0.1:50051", description="the gateway's host:port")
