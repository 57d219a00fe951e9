"""``loom.v1.Inference``: validate, tokenize, admit, tag priority, dispatch, stream, account.

Order of refusals: authentication (interceptor), then each bad field (INVALID_ARGUMENT), then the
tenant's status and model access (PERMISSION_DENIED), the model's existence (NOT_FOUND) and sizes
(INVALID_ARGUMENT), then quotas (RESOURCE_EXHAUSTED with a retry delay). Once admitted, the lease is
held for the stream's lifetime and finished exactly once however the stream ends, recording the
tokens actually delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from gateway.api import pb, pb_grpc
from gateway.auth import current_principal
from gateway.catalog import ModelCatalog, ModelRoute
from gateway.errors import GatewayError, abort, invalid_argument
from gateway.metrics import E2E, GENERATION_TOKENS, PROMPT_TOKENS, REFUSALS, REQUESTS, TPOT, TTFT
from gateway.pools import WorkerLostError
from gateway.resume import resumable_stream
from gateway.settings import GatewaySettings
from gateway.validation import ValidRequest, validate
from tenancy import Limit, Tenancy, TenancyError, Tenant
from worker.api import (
    EngineDeadError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TemplateError,
)

log = logging.getLogger(__name__)

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def _tenancy_error(exc: TenancyError) -> GatewayError:
    code = getattr(
        grpc.StatusCode, getattr(exc, "grpc_code", "PERMISSION_DENIED"), grpc.StatusCode.PERMISSION_DENIED
    )
    return GatewayError(code, str(exc))


@dataclass
class _Prepared:
    route: ModelRoute
    request: GenerationRequest
    priority: str


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, tenancy: Tenancy, catalog: ModelCatalog, settings: GatewaySettings) -> None:
        self.tenancy = tenancy
        self.catalog = catalog
        self.settings = settings

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        tenant = current_principal().tenant
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(id=r.model, context_length=r.context_length, pool=r.pool.name)
                for r in self.catalog.visible_to(tenant)
            ]
        )

    def _prepare(self, tenant: Tenant, v: ValidRequest) -> _Prepared:
        """Everything up to admission: access, the model, tokens, limits. Raises GatewayError."""
        try:
            self.tenancy.check_request(tenant, model=v.model, prompt_tokens=0, max_tokens=1)
        except TenancyError as exc:
            raise _tenancy_error(exc) from None
        route = self.catalog.route(tenant, v.model)
        tok = route.tokenizer
        try:
            ids = tok.encode_chat(v.messages) if v.messages is not None else tok.encode(v.prompt or "")
        except TemplateError as exc:
            raise invalid_argument([("messages", str(exc))]) from None
        n = len(ids)
        if n == 0:
            raise invalid_argument([("prompt", "is empty after tokenization")])
        room = route.context_length - n
        if room < 1:
            raise invalid_argument(
                [
                    (
                        "prompt",
                        f"{n} tokens leave no room in {v.model}'s context of {route.context_length} tokens",
                    )
                ]
            )
        if v.max_tokens is None:
            cap = tenant.quotas.max_tokens_per_request
            max_tokens = min(self.settings.default_max_tokens, cap if cap is not None else room, room)
        else:
            max_tokens = min(v.max_tokens, room)  # the context bounds generation; finish_reason says length
        try:
            self.tenancy.check_request(tenant, model=v.model, prompt_tokens=n, max_tokens=max_tokens)
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=v.temperature,
                top_p=v.top_p,
                top_k=v.top_k,
                seed=v.seed,
                stop=v.stop,
            )
        except TenancyError as exc:
            raise _tenancy_error(exc) from None
        except InvalidRequestError as exc:
            raise invalid_argument([(exc.field, exc.detail)]) from None
        priority = tenant.effective_priority(v.priority_hint)
        request = GenerationRequest(
            request_id=f"{tenant.id}/{v.request_id}",
            prompt_token_ids=ids,
            sampling=sampling,
            tenant=tenant.id,
            priority=priority,
            weight=tenant.weight,
            cache_salt=self.tenancy.prefix_cache_salt(tenant.id),
        )
        return _Prepared(route, request, str(priority))

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        started = time.monotonic()
        tenant = current_principal().tenant
        priority = "unknown"
        code = grpc.StatusCode.OK
        try:
            v = validate(request)
            prepared = self._prepare(tenant, v)
            priority = prepared.priority
            async for response in self._admitted_stream(tenant, v, prepared, started):
                yield response
        except GatewayError as err:
            code = err.code
            if err.limit is not None:
                REFUSALS.labels(tenant.id, err.limit).inc()
            elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                REFUSALS.labels(tenant.id, code.name.lower()).inc()
            await abort(context, err)
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if remaining is not None and remaining <= 0
                else grpc.StatusCode.CANCELLED
            )
            raise
        finally:
            REQUESTS.labels(tenant.id, priority, code.name).inc()

    async def _admitted_stream(
        self, tenant: Tenant, v: ValidRequest, p: _Prepared, started: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        n_prompt = len(p.request.prompt_token_ids)
        admission = await self.tenancy.admission.admit(
            tenant, v.request_id, n_prompt, p.request.sampling.max_tokens
        )
        if not admission.granted:
            if admission.limit is Limit.DUPLICATE_REQUEST:
                raise GatewayError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {v.request_id!r} was already used; send a new one",
                )
            wait = admission.retry_after_s
            hint = f"; retry in {wait:.2f} s" if wait is not None else "; retrying cannot help"
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{admission.limit} quota exhausted{hint}",
                retry_after_s=wait,
                limit=str(admission.limit),
            )
        if admission.duplicate:  # the same request id is streaming right now: its lease is not ours
            raise GatewayError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {v.request_id!r} is already in flight"
            )
        PROMPT_TOKENS.labels(tenant.id).inc(n_prompt)
        if self.settings.log_prompts:
            log.info("request %s tenant %s prompt %r", v.request_id, tenant.id, v.prompt or v.messages)
        first_token_at: float | None = None
        last_token_at = started
        delivered = 0
        async with self.tenancy.admission.hold(tenant, admission) as lease:
            try:
                async for out in resumable_stream(p.route.pool, p.request, p.route.tokenizer):
                    now = time.monotonic()
                    if out.token_ids:
                        if first_token_at is None:
                            first_token_at = now
                            TTFT.labels(p.priority).observe(now - started)
                        last_token_at = now
                        delivered += len(out.token_ids)
                        GENERATION_TOKENS.labels(tenant.id).inc(len(out.token_ids))
                    lease.completion_tokens = out.completion_tokens
                    response = pb.GenerateResponse(
                        request_id=v.request_id, text=out.text, token_ids=out.token_ids
                    )
                    if out.finished:
                        response.finish_reason = _FINISH[out.finish_reason]
                        response.usage.prompt_tokens = out.prompt_tokens
                        response.usage.completion_tokens = out.completion_tokens
                        response.usage.cached_prompt_tokens = out.cached_prompt_tokens
                    yield response
                    if out.finish_reason is FinishReason.ERROR:
                        raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"the engine failed: {out.error}")
            except (WorkerLostError, EngineDeadError) as exc:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            except InvalidRequestError as exc:  # the engine disagreed with the gateway's checks
                raise invalid_argument([(exc.field, exc.detail)]) from None
        E2E.labels(p.priority).observe(time.monotonic() - started)
        if first_token_at is not None and delivered > 1:
            TPOT.labels(p.priority).observe((last_token_at - first_token_at) / (delivered - 1))
