"""``loom.v1.Inference`` over gRPC: a thin adapter over the request path (gateway/request_path.py).

It only translates: a ``GenerateRequest`` into the neutral request (finding what only protobuf can
get wrong: an unknown ``Priority`` value), neutral deltas into ``GenerateResponse`` messages, and
refusals into gRPC statuses (gateway/grpc/status.py). Every rule lives in the path, once for all fronts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from common import Priority
from gateway.errors import ErrorKind, GatewayError, invalid_argument
from gateway.grpc.auth import Undecodable, current_principal
from gateway.grpc.status import abort
from gateway.grpc.stubs import pb, pb_grpc
from gateway.request_path import RequestPath
from gateway.schema import ChatMessage, Delta, InferenceRequest
from gateway.stall_watch import StreamStalled
from protocol.limits import LIMITS, Violation
from protocol.requests import FinishReason
from protocol.structured import Constraint, ConstraintKind

log = logging.getLogger(__name__)

_PRIORITIES = {
    pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE,
    pb.PRIORITY_STANDARD: Priority.STANDARD,
    pb.PRIORITY_BATCH: Priority.BATCH,
}
_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
# proto3 ``optional`` fields: when absent, the neutral request's default applies (one place for them).
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "speculative")


def to_request(message: pb.GenerateRequest) -> tuple[InferenceRequest, list[Violation]]:
    """The neutral request, and the fields protobuf decoding found bad (reported with the rest)."""
    bad: list[Violation] = []
    priority = _PRIORITIES.get(message.priority)
    if priority is None and message.priority != pb.PRIORITY_UNSPECIFIED:
        bad.append(("priority", f"unknown priority {message.priority}"))
    if len(message.messages) > LIMITS.max_messages:
        bad.append(("messages", f"at most {LIMITS.max_messages} messages, got {len(message.messages)}"))
    if len(message.stop) > LIMITS.max_stop_strings:
        bad.append(("stop", f"at most {LIMITS.max_stop_strings} stop strings, got {len(message.stop)}"))
    request = InferenceRequest(
        model=message.model,
        prompt=message.prompt or None,  # proto3 cannot tell "" from unset: both mean no prompt
        # Long lists are refused by their length; only what that check needs is converted.
        messages=tuple(ChatMessage(m.role, m.content) for m in message.messages[: LIMITS.max_messages])
        or None,
        stop=tuple(message.stop[: LIMITS.max_stop_strings]),
        priority=priority,
        request_id=message.request_id or None,
        n=message.n or 1,
        user=message.user or None,
        constraint=_constraint(message, bad),
        **{name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)},
    )
    return request, bad


def _constraint(message: pb.GenerateRequest, bad: list[Violation]) -> Constraint | None:
    which = message.WhichOneof("constraint")
    if which is None:
        return None
    if which == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT, source=which) if message.json_object else None
    if which == "choice":
        options = message.choice.options
        if len(options) > LIMITS.max_choice_options:  # its length first: a long list is not converted
            bad.append(("choice", f"at most {LIMITS.max_choice_options} choices, got {len(options)}"))
            return None
        return Constraint(ConstraintKind.CHOICE, choices=tuple(options), source="choice.options")
    return Constraint(ConstraintKind(which), getattr(message, which), source=which)


def to_response(delta: Delta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=delta.request_id, text=delta.text, token_ids=delta.token_ids, index=delta.index
    )
    for lp in delta.logprobs or ():
        response.logprobs.add(
            token=lp.token,
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token=t.token, token_id=t.token_id, logprob=t.logprob) for t in lp.top],
        )
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH[delta.finish_reason]
    if delta.usage is not None:
        response.usage.prompt_tokens = delta.usage.prompt_tokens
        response.usage.completion_tokens = delta.usage.completion_tokens
        response.usage.cached_prompt_tokens = delta.usage.cached_prompt_tokens
    return response


def _ended_early(context: grpc.aio.ServicerContext) -> ErrorKind:
    """The code gRPC gave a client whose call stopped before the stream's end."""
    remaining = context.time_remaining()
    return ErrorKind.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else ErrorKind.CANCELLED


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, path: RequestPath) -> None:
        self.path = path

    async def ListModels(
        self, request: pb.ListModelsRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        if isinstance(request, Undecodable):
            await abort(context, invalid_argument([("request", request.reason)]))
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(id=m.id, context_length=m.context_length, pool=m.pool)
                for m in self.path.list_models(current_principal())
            ]
        )

    async def Generate(
        self, request: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> None:
        if isinstance(request, Undecodable):
            err = invalid_argument([("request", request.reason)])
            self.path.record_refusal(current_principal(), err)
            await abort(context, err)
        neutral, decode_violations = to_request(request)
        stalled = False
        deltas = self.path.generate(
            current_principal(),
            neutral,
            decode_violations=decode_violations,
            ended_early=lambda: ErrorKind.DEADLINE_EXCEEDED if stalled else _ended_early(context),
        )
        watch, writer = self.path.stall_watch, asyncio.current_task()
        assert writer is not None
        try:
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    # A write waits only once the transport's buffers are full: a client that reads
                    # nothing for stall_s loses its stream (and its lease, slot and buffered output).
                    response = to_response(delta)
                    try:
                        await watch.write(writer, context.write(response))
                    except StreamStalled:
                        stalled = True
                        break
                    except Exception:  # grpc refused the write: the call is over (the client cancelled
                        # or dropped, and grpc has not cancelled this handler yet): the client left
                        log.debug("a write to a finished Generate call failed", exc_info=True)
                        break
        except GatewayError as err:
            await abort(context, err)
        except Exception:  # a bug in translating: INTERNAL, never a traceback or a class name
            log.exception("Generate failed outside the request path")
            await abort(context, GatewayError(ErrorKind.INTERNAL, "internal error"))
        if stalled:
            await abort(
                context,
                GatewayError(ErrorKind.DEADLINE_EXCEEDED, f"the client read nothing for {watch.stall_s:g} s"),
            )
