"""Gateway settings (``LOOM_GATEWAY_*``) and its clients' (``LOOM_API_KEY``, ``LOOM_ADDRESS``), from the
environment or constructor arguments; nothing else in Loom reads these variables."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    grammar_check_timeout_s: float = Field(
        2.0, gt=0, description="longest a request's JSON schema, regex or grammar may take to compile"
    )
    port: int = Field(50051, ge=0, le=65535, description="gRPC; 0 picks a free port")
    http_port: int | None = Field(
        8000, ge=0, le=65535, description="the OpenAI-compatible HTTP front; None disables it"
    )
    http_keepalive_s: float = Field(
        5.0, gt=0, description="idle HTTP keep-alive connections close after this"
    )
    http_header_timeout_s: float = Field(
        10.0, gt=0, description="an HTTP request's headers must arrive within this (else 408, closed)"
    )
    http_body_timeout_s: float = Field(
        60.0, gt=0, description="an HTTP request's body must arrive within this once its headers have"
    )
    http_max_connections: int = Field(
        4096, ge=1, description="open HTTP connections; more are answered 503 and closed at once"
    )
    http_max_connections_per_source: int = Field(
        512,
        ge=1,
        description="open HTTP connections from one client address (raise it when a proxy or load "
        "balancer is the only source the gateway sees)",
    )
    reuse_port: bool = Field(
        False,
        description="share the gRPC and HTTP ports with other gateway processes on this host (SO_REUSEPORT: "
        "the kernel spreads connections over them); off, a port already in use is an error",
    )
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(9464, ge=0, le=65535, description="None disables the metrics endpoint")
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = Field(None, description="set to require client certificates (mTLS)")
    tls_reload_interval_s: float = Field(
        30.0,
        ge=0,
        description="how often the TLS files are checked for a renewed certificate, served to new "
        "connections without a restart; 0 reads them only at start",
    )
    drain_grace_s: float = Field(30.0, ge=0)
    drain_refuse_s: float = Field(
        2.0,
        ge=0,
        description="the first seconds of a drain (part of drain_grace_s): the listeners stay open and the "
        "gateway itself refuses new calls with UNAVAILABLE (HTTP 503), which clients retry; a call that "
        "races the listeners' close is cancelled by gRPC instead",
    )
    # Bounds on clients, so that one that stops reading or never leaves cannot hold a lease, a
    # concurrency slot or the gateway's memory: a stream whose client reads nothing for
    # stream_stall_timeout_s (once the transport's buffers are full) is ended, and none lasts longer
    # than max_stream_duration_s.
    stream_stall_timeout_s: float = Field(30.0, gt=0)
    max_stream_duration_s: float = Field(3600.0, gt=0)
    max_streams_per_connection: int = Field(
        128, ge=1, description="HTTP/2 concurrent streams per gRPC connection"
    )
    keepalive_time_s: float = Field(30.0, gt=0, description="gRPC keepalive ping interval")
    keepalive_timeout_s: float = Field(10.0, gt=0, description="a peer that does not answer a ping is gone")
    idle_timeout_s: float = Field(
        300.0, gt=0, description="a gRPC connection with no call for this long closes"
    )
    default_max_tokens: int = Field(256, ge=1)
    max_concurrent_streams: int = Field(4096, ge=1)
    log_prompts: bool = Field(False, description="log prompt text (off: only sizes and ids are logged)")

    @model_validator(mode="after")
    def _tls_is_whole(self) -> GatewaySettings:
        """Half a TLS configuration is refused: serving plaintext where TLS was meant is worse than not
        starting."""
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (
                ("tls_cert_file", "tls_key_file") if self.tls_cert_file else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: TLS needs both the certificate and its key"
            )
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError(
                "tls_client_ca_file (client certificates, mTLS) needs tls_cert_file and tls_key_file: "
                "the server must speak TLS to check a client's certificate"
            )
        return self

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)


class ClientSettings(BaseSettings):
    """What ``loom generate`` (and other clients) use to reach a gateway."""

    model_config = SettingsConfigDict(env_prefix="LOOM_", extra="ignore")

    api_key: str | None = Field(None, description="a tenant's API key")
    address: str = Field(
        f"{GatewaySettings.model_fields['host'].default}:{GatewaySettings.model_fields['port'].default}",
        description="the gateway's host:port",
    )
