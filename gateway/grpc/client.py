"""A small asyncio client for ``loom.v1.Inference`` (used by the CLI, the tests and the load tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from gateway.grpc.stubs import pb, pb_grpc


class LoomClient:
    def __init__(
        self,
        address: str,
        api_key: str | None,
        *,
        root_certificates: bytes | None = None,
        client_cert: tuple[bytes, bytes] | None = None,  # (key, cert) for mTLS
        options: Sequence[tuple[str, Any]] = (),  # gRPC channel arguments
    ) -> None:
        self.address = address
        self.api_key = api_key
        if root_certificates is not None:
            key, cert = client_cert or (None, None)
            creds = grpc.ssl_channel_credentials(root_certificates, private_key=key, certificate_chain=cert)
            self.channel = grpc.aio.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        self.stub = pb_grpc.InferenceStub(self.channel)

    @classmethod
    def from_files(cls, address: str, api_key: str | None, ca_file: str | None) -> LoomClient:
        return cls(address, api_key, root_certificates=Path(ca_file).read_bytes() if ca_file else None)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def generate_call(self, request: pb.GenerateRequest, timeout: float | None = None) -> Any:
        """The raw streaming call (iterate it; ``.cancel()`` it; read its code and trailers)."""
        return self.stub.Generate(request, metadata=self.metadata(), timeout=timeout)

    async def generate(
        self,
        model: str,
        prompt: str | None = None,
        messages: Sequence[tuple[str, str]] | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        request = pb.GenerateRequest(model=model, prompt=prompt or "", **fields)
        for role, content in messages or ():
            request.messages.add(role=role, content=content)
        async for chunk in self.generate_call(request, timeout=timeout):
            yield chunk

    async def list_models(self) -> list[pb.ModelInfo]:
        response = await self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata())
        return list(response.models)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> LoomClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
