"""The two completion endpoints: how each one's body becomes the neutral request and how deltas
become its chunks and its whole answer. Chat and (legacy) completions differ only here."""

from __future__ import annotations

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
from gateway.schema import ChatMessage, Delta, InferenceRequest, TokenLogprobs
from protocol.limits import Violation
from protocol.requests import FinishReason

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


def _common(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model": body.model,
        "stop": _stop(body.stop),
        "n": body.n,
        "priority": body.priority,
        "request_id": body.request_id,
        "user": body.user,
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

    def chunk_choice(self, delta: Delta, first: bool, offsets: dict[int, int]) -> dict[str, Any]:
        """A streamed chunk's choice; ``offsets`` carries each choice's text offset (legacy logprobs)."""
        raise NotImplementedError

    answer_model: ClassVar[type[ChatCompletion] | type[Completion]]

    def answer_choice(self, choice: Choice, want_lp: bool) -> dict[str, Any]:
        """One choice of a whole answer, beyond its index and finish reason."""
        raise NotImplementedError

    def whole(
        self, rid: str, model: str, choices: dict[int, Choice], usage: dict[str, Any], want_lp: bool
    ) -> BaseModel:
        return self.answer_model.model_validate(
            {
                "id": self.id_prefix + rid,
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {"index": i, **self.answer_choice(c, want_lp), "finish_reason": c.finish_reason}
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
        roles = {"developer": "system"}  # OpenAI's newer name for the system turn
        messages = tuple(ChatMessage(roles.get(m.role, m.role), _text_of(m.content)) for m in body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        request = InferenceRequest(
            messages=messages or None,
            max_tokens=max_tokens,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            **_common(body),
        )
        return request, bad

    def chunk_choice(self, delta: Delta, first: bool, offsets: dict[int, int]) -> dict[str, Any]:
        d: dict[str, Any] = {"content": delta.text}
        if first:
            d["role"] = "assistant"
        lp = chat_logprobs(delta.logprobs) if delta.logprobs is not None else None
        finish = FINISH.get(delta.finish_reason) if delta.finish_reason else None
        return {"index": delta.index, "delta": d, "logprobs": lp, "finish_reason": finish}

    def answer_choice(self, choice: Choice, want_lp: bool) -> dict[str, Any]:
        return {
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": chat_logprobs(choice.logprobs) if want_lp else None,
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
            prompt=prompt or None, max_tokens=body.max_tokens, logprobs=body.logprobs, **_common(body)
        )
        return request, bad

    def chunk_choice(self, delta: Delta, first: bool, offsets: dict[int, int]) -> dict[str, Any]:
        lp = None
        if delta.logprobs is not None:
            lp, offsets[delta.index] = completion_logprobs(delta.logprobs, offsets.get(delta.index, 0))
        finish = FINISH.get(delta.finish_reason) if delta.finish_reason else None
        return {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": finish}

    def answer_choice(self, choice: Choice, want_lp: bool) -> dict[str, Any]:
        return {
            "text": choice.text,
            "logprobs": completion_logprobs(choice.logprobs, 0)[0] if want_lp else None,
        }

    def wants_logprobs(self, body: CompletionRequest) -> bool:
        return body.logprobs is not None


CHAT, COMPLETIONS = Chat(), Completions()


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
