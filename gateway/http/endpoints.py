"""The two completion endpoints: how each one's body becomes the neutral request and how deltas
become its chunks and its whole answer. Chat and (legacy) completions differ only here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel

from gateway.http.schema import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    unsupported_fields,
)
from gateway.http.tools import ToolPlan, ToolShaper, plan_tools, tool_turns
from gateway.schema import ChatMessage, Delta, InferenceRequest, TokenLogprobs
from protocol.limits import Violation
from protocol.requests import FinishReason
from protocol.structured import Constraint, ConstraintKind

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass
class Choice:
    """What a non-streamed answer accumulates for one choice."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs or ()
        if delta.finish_reason is not None:
            self.finish_reason = FINISH.get(delta.finish_reason)


def usage_json(delta: Delta) -> dict[str, Any]:
    u = delta.usage
    assert u is not None
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _schema_text(value: Any, name: str, bad: list[Violation]) -> str | None:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (ValueError, RecursionError):
        bad.append((name, "is not a JSON schema that can be written back as JSON"))
        return None


def output_constraint(
    body: ChatCompletionRequest | CompletionRequest, bad: list[Violation]
) -> Constraint | None:
    """The one output constraint the body asks for, from OpenAI's ``response_format`` or vLLM's
    ``structured_outputs`` (or its older ``guided_*`` fields); two at once are refused."""
    found: list[Constraint] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(Constraint(ConstraintKind.JSON_OBJECT, source="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        given = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if given is None:
            bad.append(("response_format.json_schema.schema", "is required for type json_schema"))
        elif (text := _schema_text(given, "response_format.json_schema.schema", bad)) is not None:
            found.append(
                Constraint(ConstraintKind.JSON_SCHEMA, text, source="response_format.json_schema.schema")
            )
    so = body.structured_outputs
    if so is not None:
        for name in ("json_", "regex", "choice", "grammar", "json_object"):
            value = getattr(so, name)
            if value is None or value is False:
                continue
            wire = name.rstrip("_")
            found.append(_vllm_constraint(wire, value, f"structured_outputs.{wire}", bad))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(body, name)
        if value is not None:
            found.append(_vllm_constraint(name.removeprefix("guided_"), value, name, bad))
    if len(found) > 1:
        bad.append((found[1].source, f"only one output constraint may be set (also {found[0].source})"))
    return found[0] if found else None


def _vllm_constraint(kind: str, value: Any, source: str, bad: list[Violation]) -> Constraint:
    if kind == "json":
        return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(value, source, bad) or "", source=source)
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT, source=source)
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(value), source=source)
    return Constraint(ConstraintKind(kind), value, source=source)


def _common(body: ChatCompletionRequest | CompletionRequest, bad: list[Violation]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "constraint": output_constraint(body, bad),
        "model": body.model,
        "stop": _stop(body.stop),
        "n": body.n,
        "priority": body.priority,
        "request_id": body.request_id,
        "user": body.user,
        "speculative": body.speculative,
    }
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    return fields


class Endpoint:
    """One completion endpoint: its body model, its object names, and its encodings."""

    body_model: ClassVar[type[ChatCompletionRequest] | type[CompletionRequest]]
    object: ClassVar[str]  # of a whole answer
    chunk_object: ClassVar[str]  # of a streamed chunk
    id_prefix: ClassVar[str]

    def to_request(self, body: Any) -> tuple[InferenceRequest, list[Violation]]:
        raise NotImplementedError

    def stream_state(self, body: Any) -> dict[int, Any]:
        """What one streamed answer keeps per choice between its chunks (given to ``chunk_choice``)."""
        return {}

    def chunk_choice(self, delta: Delta, first: bool, state: dict[int, Any]) -> dict[str, Any] | None:
        """A streamed chunk's choice (None: nothing to send for this delta yet)."""
        raise NotImplementedError

    answer_model: ClassVar[type[ChatCompletion] | type[Completion]]

    def answer_choice(self, choice: Choice, want_lp: bool, body: Any) -> dict[str, Any]:
        """One choice of a whole answer, beyond its index (and its finish reason, unless this sets it)."""
        raise NotImplementedError

    def whole(self, rid: str, body: Any, choices: dict[int, Choice], usage: dict[str, Any]) -> BaseModel:
        want_lp = self.wants_logprobs(body)
        return self.answer_model.model_validate(
            {
                "id": self.id_prefix + rid,
                "created": int(time.time()),
                "model": body.model,
                "choices": [
                    {"index": i, "finish_reason": c.finish_reason, **self.answer_choice(c, want_lp, body)}
                    for i, c in sorted(choices.items())
                ],
                "usage": usage,
            }
        )

    def wants_logprobs(self, body: Any) -> bool:
        raise NotImplementedError


class Chat(Endpoint):
    body_model = ChatCompletionRequest
    answer_model = ChatCompletion
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def to_request(self, body: ChatCompletionRequest) -> tuple[InferenceRequest, list[Violation]]:
        bad = unsupported_fields(body)
        if body.top_logprobs is not None and not body.logprobs:
            bad.append(("top_logprobs", "needs logprobs: true"))
        plan, tool_bad = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        bad += tool_bad
        if plan is not None and not body.messages:  # the tools' system turn is not a conversation
            bad.append(("messages", "needs at least one message"))
        body.tool_plan = plan
        messages = _chat_messages(body, plan)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        fields = _common(body, bad)
        if plan is not None and fields["constraint"] is not None:
            # A forced call is a constraint of its own; with auto, another constraint would keep the
            # model from ever writing a call.
            bad.append(("tool_choice", f"tools cannot be combined with {fields['constraint'].source}"))
        if plan is not None and (forced := plan.constraint()) is not None:
            if body.stop:
                bad.append(("stop", "cannot be used with a forced tool call (it would cut the arguments)"))
            fields["constraint"] = forced
        request = InferenceRequest(
            messages=messages or None,
            max_tokens=max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            **fields,
        )
        return request, bad

    def stream_state(self, body: ChatCompletionRequest) -> dict[int, Any]:
        return _ShaperPerChoice(body.tool_plan)

    def chunk_choice(self, delta: Delta, first: bool, state: dict[int, Any]) -> dict[str, Any] | None:
        d: dict[str, Any] = {"content": delta.text}
        finish = FINISH.get(delta.finish_reason) if delta.finish_reason else None
        shaper: ToolShaper | None = state[delta.index]
        if shaper is not None:
            content, calls = shaper.feed(delta.text)
            if delta.finish_reason is not None:
                more, later = shaper.finish()
                content, calls = content + more, calls + later
                if shaper.calls and _calls_complete(shaper, delta.finish_reason):
                    finish = "tool_calls"
            d = {"content": content or None}
            if calls:
                d["tool_calls"] = calls
            if not content and not calls and not first and finish is None and delta.logprobs is None:
                return None
        if first:
            d["role"] = "assistant"
        lp = chat_logprobs(delta.logprobs) if delta.logprobs is not None else None
        return {"index": delta.index, "delta": d, "logprobs": lp, "finish_reason": finish}

    def answer_choice(self, choice: Choice, want_lp: bool, body: ChatCompletionRequest) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        shaped: dict[str, Any] = {}
        if body.tool_plan is not None:
            shaper = ToolShaper(body.tool_plan)
            content, calls = shaper.feed(choice.text)
            more, later = shaper.finish()
            whole_calls = _merge_calls(calls + later)
            message = {"role": "assistant", "content": (content + more) or None}
            if whole_calls:
                message["tool_calls"] = whole_calls
                reason = FinishReason.STOP if choice.finish_reason == "stop" else FinishReason.LENGTH
                if choice.finish_reason in ("stop", "length") and _calls_complete(shaper, reason):
                    shaped["finish_reason"] = "tool_calls"
        return {
            "message": message,
            "logprobs": chat_logprobs(choice.logprobs) if want_lp else None,
            **shaped,
        }

    def wants_logprobs(self, body: ChatCompletionRequest) -> bool:
        return body.logprobs


class Completions(Endpoint):
    body_model = CompletionRequest
    answer_model = Completion
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def to_request(self, body: CompletionRequest) -> tuple[InferenceRequest, list[Violation]]:
        bad = unsupported_fields(body)
        prompt = body.prompt[0] if isinstance(body.prompt, list) else body.prompt  # one, by the schema
        request = InferenceRequest(
            prompt=prompt or None, max_tokens=body.max_tokens, logprobs=body.logprobs, **_common(body, bad)
        )
        return request, bad

    def chunk_choice(self, delta: Delta, first: bool, state: dict[int, Any]) -> dict[str, Any] | None:
        lp = None
        if delta.logprobs is not None:  # the state is each choice's text offset (legacy logprobs)
            lp, state[delta.index] = completion_logprobs(delta.logprobs, state.get(delta.index, 0))
        finish = FINISH.get(delta.finish_reason) if delta.finish_reason else None
        return {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": finish}

    def answer_choice(self, choice: Choice, want_lp: bool, body: CompletionRequest) -> dict[str, Any]:
        return {
            "text": choice.text,
            "logprobs": completion_logprobs(choice.logprobs, 0)[0] if want_lp else None,
        }

    def wants_logprobs(self, body: CompletionRequest) -> bool:
        return body.logprobs is not None


CHAT, COMPLETIONS = Chat(), Completions()


class _ShaperPerChoice(dict[int, ToolShaper | None]):
    """A streamed chat answer's tool-call reader per choice (None for every choice without tools)."""

    def __init__(self, plan: ToolPlan | None) -> None:
        super().__init__()
        self.plan = plan

    def __missing__(self, index: int) -> ToolShaper | None:
        shaper = self[index] = ToolShaper(self.plan) if self.plan is not None else None
        return shaper


def _merge_calls(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call entries folded into whole calls (a whole answer's ``tool_calls``)."""
    calls: dict[int, dict[str, Any]] = {}
    for e in entries:
        call = calls.get(e["index"])
        if call is None:
            calls[e["index"]] = {k: v for k, v in e.items() if k != "index"}
            calls[e["index"]]["function"] = dict(e["function"])
        else:
            call["function"]["arguments"] += e["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def _chat_messages(body: ChatCompletionRequest, plan: ToolPlan | None) -> tuple[ChatMessage, ...]:
    """The conversation as the model's template takes it: earlier tool calls and results written as
    the text the model is told to write and read, and the tools listed in the system turn."""
    roles = {"developer": "system", "tool": "user"}  # OpenAI's newer name for the system turn
    messages = [
        ChatMessage(roles.get(m.role, m.role), tool_turns(m, text) or text)
        for m in body.messages
        for text in (_text_of(m.content),)
    ]
    if plan is not None:
        if messages and messages[0].role == "system":
            messages[0] = ChatMessage("system", messages[0].content + "\n\n" + plan.system_text())
        else:
            messages.insert(0, ChatMessage("system", plan.system_text()))
    return tuple(messages)


def _calls_complete(shaper: ToolShaper, reason: FinishReason) -> bool:
    """Whether the calls sent are whole: the output ended by itself, or (auto) each call was parsed
    from its closing tag before max_tokens cut what followed."""
    return reason is FinishReason.STOP or (reason is FinishReason.LENGTH and shaper.plan.mode == "auto")


def _text_of(content: str | list[Any] | None) -> str:
    if isinstance(content, list):  # parts that are not objects were refused by unsupported_fields
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content or ""


def _top(entries: list[Any]) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in entries]


def chat_logprobs(items: list[TokenLogprobs] | tuple[TokenLogprobs, ...]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode()),
                "top_logprobs": _top(list(lp.top)),
            }
            for lp in items
        ]
    }


def completion_logprobs(
    items: list[TokenLogprobs] | tuple[TokenLogprobs, ...], offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object, and the text offset after these tokens."""
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.token)
    body = {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
        "text_offset": offsets,
    }
    return body, offset
