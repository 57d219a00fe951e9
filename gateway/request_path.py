"""The one request path every front calls; the gRPC servicer and the HTTP front only translate.

A completion request goes through these steps, each a method of :class:`RequestPath`:

1. ``authenticate``: the ``authorization`` value -> the caller's :class:`~tenancy.Principal`;
2. ``validate`` (gateway/validation.py): every bad field named at once;
3. ``_route``: the tenant's status and model access, then the model's existence in its pool;
4. ``_tokenize``: the prompt, or the messages through the model's chat template, to token ids;
5. ``_size``: the prompt must leave room in the context; ``max_tokens`` resolved and bounded;
   the tenant's per-request limits;
6. ``_tag``: the engine request: priority (hint capped by the tenant's ceiling) and the tenant's
   prefix-cache salt, both decided here, never taken from the client;
7. ``_admit``: quotas, in one atomic call to the admission backend (Redis, or in-process);
8. ``_dispatch``: the lease is held while the stream from the engine pool (resumed on another replica
   if one is lost) is turned into neutral deltas; leaving it settles usage exactly once.

So refusals come in this order: authentication (UNAUTHENTICATED), bad fields (INVALID_ARGUMENT), the
tenant's status and model access (PERMISSION_DENIED), the model's existence (NOT_FOUND, or UNAVAILABLE
when the tenant's pool is not deployed), sizes (INVALID_ARGUMENT), then quotas (RESOURCE_EXHAUSTED
with a retry delay; ALREADY_EXISTS for a request id already used). Tagging refuses nothing, so it
runs before admission: a quota refusal is then counted under the request's priority.

Metrics are recorded here, once, whatever the front: calls by their final code, latencies, tokens and
refusals. Only a front knows whether its client went away or its deadline passed, so it tells the path
(``ended_early``). This module and its helpers import no gRPC; a test holds that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from gateway.catalog import ModelCatalog, ModelRoute
from gateway.constraints import ConstraintChecks
from gateway.engine_pool import WorkerLostError
from gateway.errors import ErrorKind, GatewayError, from_tenancy, invalid_argument
from gateway.metrics import (
    AUTH_REFUSALS,
    E2E,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REFUSALS,
    REQUESTS,
    TPOT,
    TTFT,
)
from gateway.pre_admission import FairSlots, PreAdmission, Ticket
from gateway.resume import resumable_stream
from gateway.schema import Delta, InferenceRequest, ServedModel, TokenLogprobs, TopLogprob, Usage
from gateway.settings import GatewaySettings
from gateway.slo import SloAdmission, record_outcome
from gateway.stall_watch import StallWatch
from gateway.stream_deadline import StreamDeadline
from gateway.validation import ValidRequest, validate
from protocol.adapters import LoraRequest
from protocol.limits import LIMITS, Violation
from protocol.requests import (
    EngineDeadError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    KvShare,
    RequestOutput,
    SamplingParams,
)
from protocol.tokenizer import TemplateError, Tokenizer
from tenancy import Admission, AuthenticationError, Limit, Outcome, Principal, Tenancy, TenancyError, Tenant

log = logging.getLogger(__name__)

# Below this many UTF-8 bytes a prompt is tokenized on the event loop: the work takes microseconds,
# less than a hop to a worker thread. Above it, a thread keeps a huge prompt from stalling every stream.
INLINE_TOKENIZE_BYTES = 16 * 1024
# Large prompts are tokenized on a thread, one at a time per lane and gateway: each takes a core for up
# to a second (1 MB), so a tenant sending many cannot take every core from the streams of the others;
# the rest wait their turn, taken by tenant in turn. Prompts up to HUGE_TOKENIZE_BYTES have a lane of
# their own, so a 20 KB prompt (milliseconds) never waits behind a 1 MB one.
HUGE_TOKENIZE_BYTES = 128 * 1024
LARGE_TOKENIZE_SLOTS = 1

OK = "OK"  # the final code of a call that streamed to its end (gRPC's name, as every other code)


def _yield_the_cpu() -> None:
    """A tokenizing thread runs at a lower priority (nice 10) than the rest of the gateway's process:
    when cores are short, a 1 MB prompt's second of work waits for the event loop, the engine and
    everyone's streams, not the other way round. Linux applies a thread id's nice to that thread."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


# One thread per tokenizing lane (see RequestPath._tokenize), shared by every gateway in the process.
_TOKENIZE_THREADS = concurrent.futures.ThreadPoolExecutor(
    max_workers=2, thread_name_prefix="loom-tokenize", initializer=_yield_the_cpu
)


def client_left() -> ErrorKind:
    """The default answer to "how did the call end early?": the client went away."""
    return ErrorKind.CANCELLED


@dataclass
class _Call:
    """What the metrics need to know about one call, filled in as the path learns it."""

    tenant: str
    started: float
    priority: str = "unknown"
    code: str = OK


class RequestPath:
    def __init__(self, tenancy: Tenancy, catalog: ModelCatalog, settings: GatewaySettings) -> None:
        self.tenancy = tenancy
        self.catalog = catalog
        self.settings = settings
        self._large_tokenize = FairSlots(LARGE_TOKENIZE_SLOTS)
        self._huge_tokenize = FairSlots(LARGE_TOKENIZE_SLOTS)
        self.pre_admission = PreAdmission()
        self.constraints = ConstraintChecks(settings.grammar_check_timeout_s)
        self.slo = SloAdmission()
        # Tenants whose request rate admission refused, and until when (see _not_known_refused).
        self._rpm_refused_until: dict[str, float] = {}
        # Both fronts' writes to clients, under one clock (a client that reads nothing loses its stream).
        self.stall_watch = StallWatch(settings.stream_stall_timeout_s)
        self.draining = False  # set when the gateway drains: new calls are refused, streams go on

    # ---- the operations fronts call ------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Principal:
        """Step 1: an ``authorization`` value (``Bearer <api key>``) -> the caller. No I/O.

        Every bad key gets the same answer, so a caller cannot learn why a key failed.
        """
        if not authorization:
            AUTH_REFUSALS.inc()
            raise GatewayError(ErrorKind.UNAUTHENTICATED, "missing 'authorization: Bearer <api key>'")
        try:
            return self.tenancy.authenticate(authorization)
        except AuthenticationError as exc:
            AUTH_REFUSALS.inc()
            raise GatewayError(ErrorKind.UNAUTHENTICATED, str(exc)) from None

    def enter(self, principal: Principal) -> Ticket:
        """A place in the tenant's bound on requests not yet admitted (gateway/pre_admission.py),
        taken by a front before it reads a body; RESOURCE_EXHAUSTED (counted) past the bound."""
        try:
            return self.pre_admission.enter(principal.tenant)
        except GatewayError as err:
            self.record_refusal(principal, err)
            raise

    def record_refusal(self, principal: Principal, err: GatewayError) -> None:
        """Count a refusal a front made before the path could run (a body it could not decode)."""
        _count_refusal(principal.tenant.id, err)
        REQUESTS.labels(principal.tenant.id, "unknown", err.kind.name).inc()

    def list_models(self, principal: Principal) -> list[ServedModel]:
        """The models this caller may use, in the pool that serves its tenant: the base models, then
        the tenant's own adapters over them (``<base>:<adapter>``; nobody else sees those). A
        suspended tenant is refused (PERMISSION_DENIED), as its completions are."""
        tenant = principal.tenant
        self._check(tenant, None, prompt_tokens=0, max_tokens=1)
        bases = [ServedModel(r.model, r.context_length, r.pool.name) for r in self.catalog.visible_to(tenant)]
        by_name = {m.id: m for m in bases}
        adapters = [
            ServedModel(
                f"{rec.base_model}:{name}",
                by_name[rec.base_model].context_length,
                by_name[rec.base_model].pool,
            )
            for name, rec in sorted(tenant.adapters.items())
            if rec.base_model in by_name
        ]
        return bases + adapters

    async def generate(
        self,
        principal: Principal,
        request: InferenceRequest,
        *,
        decode_violations: Sequence[Violation] = (),
        ended_early: Callable[[], ErrorKind] = client_left,
        ticket: Ticket | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Steps 2-8 for one completion; yields deltas, raises :class:`GatewayError` on a refusal.

        ``decode_violations``: bad fields the front found decoding its wire format, reported with the
        rest. ``ended_early``: asked when the front stops the stream (its task cancelled, or the stream
        closed) for the code its client got: CANCELLED, or DEADLINE_EXCEEDED. A front iterates to the
        end (the stream ends right after the delta with a finish reason; stopping earlier, even just
        after that delta, counts as ended early) and closes the stream when it stops
        (``contextlib.aclosing``), so the engine's work is aborted and the lease settled at once.
        ``ticket``: the front's place from :meth:`enter`, if it took one before reading the body;
        released here once the request is admitted.
        """
        tenant = principal.tenant
        call = _Call(tenant.id, time.monotonic())
        try:
            if self.draining:
                raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is draining; retry the call")
            if ticket is None:
                ticket = self.pre_admission.enter(tenant)
            valid = validate(request, decode_violations)
            route, adapter = self._route(tenant, valid.model)
            self._fits_by_size(tenant, valid, route)
            self._not_known_refused(tenant)
            if valid.constraint is not None:
                await self.constraints.check(tenant.id, route.tokenizer, valid.constraint)
            prompt_ids = await self._tokenize(route.tokenizer, valid, tenant.id)
            sampling = self._size(tenant, valid, route, len(prompt_ids))
            engine_request = self._tag(tenant, valid, prompt_ids, sampling, adapter)
            call.priority = engine_request.priority.value
            self.slo.admit(
                tenant, engine_request.priority, len(prompt_ids), route.pool.name, route.pool.replica_stats
            )
            admission = await self._admit(tenant, valid, engine_request)
            ticket.release()
            deltas = self._dispatch(tenant, valid, route, engine_request, admission, call)
            async with contextlib.aclosing(deltas):  # closing us settles the lease now, not at GC
                async for delta in deltas:
                    yield delta
        except GatewayError as err:
            call.code = err.kind.name
            _count_refusal(tenant.id, err)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            call.code = ended_early().name
            raise
        except Exception as exc:  # a bug: the client gets INTERNAL and an id to quote, the log the rest
            ref = request.request_id or uuid.uuid4().hex[:16]
            log.exception("request %s of tenant %s failed", ref, tenant.id)
            call.code = ErrorKind.INTERNAL.name
            raise GatewayError(ErrorKind.INTERNAL, f"internal error (request {ref})") from exc
        finally:
            if ticket is not None:
                ticket.release()
            REQUESTS.labels(call.tenant, call.priority, call.code).inc()

    # ---- the steps -----------------------------------------------------------------------------------

    def _check(self, tenant: Tenant, model: str | None, prompt_tokens: int, max_tokens: int) -> None:
        try:
            self.tenancy.check_request(
                tenant, model=model, prompt_tokens=prompt_tokens, max_tokens=max_tokens
            )
        except TenancyError as exc:
            raise from_tenancy(exc) from None

    def _route(self, tenant: Tenant, model: str) -> tuple[ModelRoute, LoraRequest | None]:
        """Step 3: status and model access (PERMISSION_DENIED) before the model's existence, so a
        suspended tenant learns nothing about what is deployed.

        ``<base>:<adapter>`` names one of the tenant's own LoRA adapters over a served base model;
        anyone else's adapter is refused exactly as a model that does not exist is.
        """
        self._check(tenant, model, prompt_tokens=0, max_tokens=1)
        if ":" not in model:
            return self.catalog.route(tenant, model), None
        found = tenant.adapter(model)
        if found is None:
            return self.catalog.route(tenant, model), None  # NOT_FOUND, worded as for any unknown model
        name, record = found
        route = self.catalog.route(tenant, record.base_model)
        return route, LoraRequest(record.engine_id(tenant.id, name), record.path, record.digest)

    def _not_known_refused(self, tenant: Tenant) -> None:
        """Before tokenizing: a tenant whose request rate was refused with "retry in t s" less than t
        ago is refused again at once, without spending tokenizing work that admission would then
        refuse (the bucket cannot hold a request before then). Rate only: a concurrency slot or
        tokens may come back sooner."""
        until = self._rpm_refused_until.get(tenant.id)
        if until is None:
            return
        wait = until - time.monotonic()
        if wait <= 0:
            del self._rpm_refused_until[tenant.id]
            return
        raise _quota_exhausted(Limit.REQUESTS_PER_MINUTE, wait)

    def _fits_by_size(self, tenant: Tenant, v: ValidRequest, route: ModelRoute) -> None:
        """Before tokenizing: a prompt whose UTF-8 size alone proves it has more tokens than the
        context or the tenant's prompt limit allows is refused without spending the work. No token
        covers more than the tokenizer's longest, so bytes / longest is a floor on the count."""
        floor = -(-v.prompt_bytes // route.tokenizer.max_token_bytes)
        cap = tenant.quotas.max_prompt_tokens
        if floor >= route.context_length or (cap is not None and floor > cap):
            limit = (
                f"{v.model}'s context of {route.context_length} tokens"
                if floor >= route.context_length
                else f"this tenant's limit of {cap} prompt tokens"
            )
            raise invalid_argument(
                [("prompt", f"{v.prompt_bytes} bytes are at least {floor} tokens, more than {limit}")]
            )

    async def _tokenize(self, tokenizer: Tokenizer, v: ValidRequest, tenant_id: str) -> list[int]:
        """Step 4: token ids, counted here so admission reserves exact prompt tokens before any
        replica is involved. Large prompts take turns by tenant on a few threads."""

        def encode() -> list[int]:
            if v.messages is not None:
                return tokenizer.encode_chat(v.messages)
            return tokenizer.encode(v.prompt or "")

        try:
            if v.prompt_bytes <= INLINE_TOKENIZE_BYTES:
                ids = encode()
            else:
                lane = self._large_tokenize if v.prompt_bytes <= HUGE_TOKENIZE_BYTES else self._huge_tokenize
                async with lane.slot(tenant_id):
                    ids = await asyncio.get_running_loop().run_in_executor(_TOKENIZE_THREADS, encode)
        except TemplateError as exc:  # the model has no chat template, or the template refused
            raise invalid_argument([("messages", str(exc))]) from None
        if not ids:
            raise invalid_argument([("prompt", "is empty after tokenization")])
        return ids

    def _size(self, tenant: Tenant, v: ValidRequest, route: ModelRoute, n_prompt: int) -> SamplingParams:
        """Step 5: the context bounds generation (finish_reason says length); an unset max_tokens
        takes the gateway's default, capped by the tenant's per-request limit."""
        room = route.context_length - n_prompt
        if room < 1:
            raise invalid_argument(
                [
                    (
                        "prompt",
                        f"{n_prompt} tokens leave no room in {v.model}'s context of "
                        f"{route.context_length} tokens",
                    )
                ]
            )
        if v.max_tokens is None:
            cap = tenant.quotas.max_tokens_per_request
            per_choice = max(1, cap // v.n) if cap is not None else room
            max_tokens = min(self.settings.default_max_tokens, per_choice, room)
        else:
            max_tokens = min(v.max_tokens, room)
        # n choices are one request: the tenant's per-request limits bound all they may generate.
        self._check(tenant, v.model, n_prompt, max_tokens * v.n)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=v.temperature,
                top_p=v.top_p,
                top_k=v.top_k,
                seed=v.seed,
                stop=v.stop,
                logprobs=v.logprobs,
                constraint=v.constraint,
            )
        except InvalidRequestError as exc:  # only max_tokens is new since validation
            raise invalid_argument([(exc.field, exc.detail)]) from None

    def _tag(
        self,
        tenant: Tenant,
        v: ValidRequest,
        prompt_ids: list[int],
        sampling: SamplingParams,
        adapter: LoraRequest | None = None,
    ) -> GenerationRequest:
        """Step 6: what the engine schedules by. The engine's request id is scoped by tenant, so two
        tenants' ids never collide in a replica."""
        return GenerationRequest(
            request_id=f"{tenant.id}/{v.request_id}",
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            tenant=tenant.id,
            priority=tenant.effective_priority(v.priority),
            weight=tenant.weight,
            cache_salt=self.tenancy.prefix_cache_salt(tenant.id),
            kv_share=KvShare(floor=tenant.kv_floor, cap=tenant.kv_cap),
            adapter=adapter,
            speculative=tenant.speculative if v.speculative is None else v.speculative,
        )

    async def _admit(self, tenant: Tenant, v: ValidRequest, request: GenerationRequest) -> Admission:
        """Step 7: one atomic reservation of a request: its prompt once, max_tokens for each of its
        choices, and a lease."""
        request_id = v.request_id
        n_prompt = len(request.prompt_token_ids)
        quotas = self.tenancy.admission
        # The reservation is made in one atomic call that a client's deadline or cancel must not cut
        # in half: a grant made while the caller was leaving is finished at once, not left charged.
        admitting = asyncio.ensure_future(
            quotas.admit(tenant, request_id, n_prompt, request.sampling.max_tokens * v.n)
        )
        try:
            admission = await asyncio.shield(admitting)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                late = await admitting
                if late.granted and not late.duplicate:
                    await quotas.finish(
                        tenant, request_id, 0, prompt_tokens=n_prompt, outcome=Outcome.CANCELLED
                    )
            raise
        except TenancyError as exc:
            raise from_tenancy(exc) from None
        if not admission.granted:
            if admission.limit is Limit.DUPLICATE_REQUEST:
                raise GatewayError(
                    ErrorKind.ALREADY_EXISTS, f"request_id {request_id!r} was already used; send a new one"
                )
            wait = admission.retry_after_s
            if admission.limit is Limit.REQUESTS_PER_MINUTE and wait is not None:
                self._rpm_refused_until[tenant.id] = time.monotonic() + wait
            raise _quota_exhausted(admission.limit, wait)
        if admission.duplicate:  # the same request id is streaming right now: its lease is not ours
            raise GatewayError(ErrorKind.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        return admission

    async def _dispatch(
        self,
        tenant: Tenant,
        v: ValidRequest,
        route: ModelRoute,
        request: GenerationRequest,
        admission: Admission,
        call: _Call,
    ) -> AsyncGenerator[Delta, None]:
        """Step 8: dispatch, stream, settle. The lease is renewed while the stream runs and finished
        exactly once when ``hold`` exits, however the stream ends (usage recorded: the tokens actually
        delivered; the unused reservation refunded)."""
        PROMPT_TOKENS.labels(tenant.id).inc(len(request.prompt_token_ids))
        if self.settings.log_prompts:
            log.info("request %s tenant %s prompt %r", v.request_id, tenant.id, v.prompt or v.messages)
        if v.user is not None:
            log.info("request %s tenant %s for its user %r", v.request_id, tenant.id, v.user)
        priority = call.priority
        generated = GENERATION_TOKENS.labels(tenant.id)  # one label lookup per request, not per delta
        first_token_at: float | None = None
        last_token_at = call.started
        delivered = 0
        completion = [0] * v.n  # per choice
        cached = 0
        unfinished = v.n
        async with self.tenancy.admission.hold(tenant, admission) as lease:
            outputs = _choices(route, _copies(request, v.n))
            limit_s = self.settings.max_stream_duration_s
            deadline = StreamDeadline(
                limit_s - (time.monotonic() - call.started),
                f"the stream ran past the gateway's limit of {limit_s:g} s",
            )
            try:
                async with contextlib.aclosing(outputs):
                    while True:
                        try:
                            index, out = await deadline.next(outputs)
                        except StopAsyncIteration:
                            break
                        now = time.monotonic()
                        if out.token_ids:
                            if first_token_at is None:
                                first_token_at = now
                                TTFT.labels(priority).observe(now - call.started)
                            last_token_at = now
                            delivered += len(out.token_ids)
                            generated.inc(len(out.token_ids))
                        completion[index] = out.completion_tokens
                        lease.completion_tokens = sum(completion)
                        if index == 0:
                            cached = out.cached_prompt_tokens
                        if out.finish_reason is FinishReason.ERROR and out.request_fault:
                            field = v.constraint.field_name if v.constraint is not None else "request"
                            raise invalid_argument([(field, out.error or "cannot be followed")])
                        if out.finish_reason is FinishReason.ERROR:
                            log.warning("engine failed request %s: %s", request.request_id, out.error)
                            raise GatewayError(
                                ErrorKind.UNAVAILABLE,
                                f"the engine failed request {v.request_id} after it started; retry it",
                            )
                        unfinished -= out.finished
                        usage = (
                            Usage(len(request.prompt_token_ids), sum(completion), cached)
                            if unfinished == 0
                            else None
                        )
                        yield _delta(v.request_id, index, out, usage, route.tokenizer)
            except (WorkerLostError, EngineDeadError) as exc:
                raise GatewayError(ErrorKind.UNAVAILABLE, str(exc)) from None
            except InvalidRequestError as exc:  # the engine disagreed with the gateway's checks
                raise invalid_argument([(exc.field, exc.detail)]) from None
            finally:
                deadline.close()
        E2E.labels(priority).observe(time.monotonic() - call.started)
        tpot = None
        if first_token_at is not None and delivered > 1:
            tpot = (last_token_at - first_token_at) / (delivered - 1)
            TPOT.labels(priority).observe(tpot)
        ttft = first_token_at - call.started if first_token_at is not None else None
        record_outcome(tenant, request.priority, ttft, tpot)


def _copies(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of n choices: their own ids, and seeds that differ but stay reproducible."""
    if n == 1:
        return [request]
    seed = request.sampling.seed
    return [
        dataclasses.replace(
            request,
            request_id=f"{request.request_id}/{i}",
            sampling=dataclasses.replace(
                request.sampling, seed=None if seed is None else (seed + i) % LIMITS.seed_bound
            ),
        )
        for i in range(n)
    ]


async def _choices(
    route: ModelRoute, requests: list[GenerationRequest]
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Every choice's outputs as (index, output), interleaved as they come.

    Choices after the first start when the first has produced its first output: its prompt's full KV
    blocks are in the prefix cache by then (the router keeps the prompt on that replica), so the other
    copies compute only the prompt's last partial block.
    """
    if len(requests) == 1:
        async with contextlib.aclosing(resumable_stream(route.pool, requests[0])) as outs:
            async for out in outs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
    first_output = asyncio.Event()

    async def pump(index: int, request: GenerationRequest) -> None:
        try:
            if index > 0:
                await first_output.wait()
            async with contextlib.aclosing(resumable_stream(route.pool, request)) as outs:
                async for out in outs:
                    first_output.set()
                    queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as exc:  # handed to the consumer, which fails the whole request
            queue.put_nowait((index, exc))
        finally:
            first_output.set()  # a first choice that failed must not hold the others back

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _delta(
    request_id: str, index: int, out: RequestOutput, usage: Usage | None, tokenizer: Tokenizer
) -> Delta:
    """An engine output as a neutral delta, echoing the client's request id (not the engine's)."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = tuple(
            TokenLogprobs(
                tokenizer.decode([lp.token_id]),
                lp.token_id,
                lp.logprob,
                tuple(TopLogprob(tokenizer.decode([t]), t, v) for t, v in lp.top),
            )
            for lp in out.logprobs
        )
    return Delta(request_id, out.text, tuple(out.token_ids), out.finish_reason, usage, index, logprobs)


def _quota_exhausted(limit: Limit | None, wait: float | None) -> GatewayError:
    """RESOURCE_EXHAUSTED for a quota, with the wait that can help (None: none can)."""
    hint = f"; retry in {wait:.2f} s" if wait is not None else "; retrying cannot help"
    return GatewayError(
        ErrorKind.RESOURCE_EXHAUSTED, f"{limit} quota exhausted{hint}", retry_after_s=wait, limit=str(limit)
    )


def _count_refusal(tenant_id: str, err: GatewayError) -> None:
    """Refusals by reason: the quota that refused, or the client's mistake (bad field, no access)."""
    if err.limit is not None:
        REFUSALS.labels(tenant_id, err.limit).inc()
    elif err.kind in (ErrorKind.INVALID_ARGUMENT, ErrorKind.PERMISSION_DENIED):
        REFUSALS.labels(tenant_id, err.kind.value).inc()
