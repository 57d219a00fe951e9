"""Streams that record exactly what their client received, and the greedy reference they are checked
against: shared by ``loom soak`` (loadtest/soak.py) and the fault tests (tests/faults).

A stream is checked token for token (gRPC carries the token ids) or character for character and by
count (HTTP: text, and one log-probability entry per token) against an uninterrupted greedy run of
the same prompt by the engine in this process, on the same weights: a stream that completed must equal
it, a stream its client cut must be its beginning. Nothing lost, duplicated or reordered, whatever
happened to the replica, the quota store or the connection on the way.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from gateway.grpc.client import LoomClient
from gateway.grpc.stubs import pb
from protocol.engine_config import EngineConfig
from protocol.model_files import load_tokenizer
from protocol.requests import GenerationRequest, SamplingParams
from worker.api import LLMEngine


@dataclass
class Received:
    """What one client received from one stream."""

    tenant_id: str
    prompt: str
    max_tokens: int
    front: str = "grpc"
    model: str = "tiny"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:20])
    token_ids: list[int] = field(default_factory=list)  # gRPC: the token ids, in order
    tokens: int = 0  # tokens received (gRPC: ids; HTTP: one log-probability entry per token)
    text: str = ""
    finish_reason: str | None = None  # set when the stream's final delta arrived
    usage_completion: int | None = None
    code: str = "OK"  # gRPC status name, or the HTTP status as a string
    message: str = ""
    cancelled: bool = False  # the client left before the end

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def grpc_request(r: Received, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=r.model,
        prompt=r.prompt,
        max_tokens=r.max_tokens,
        temperature=0.0,
        request_id=r.request_id,
        **fields,
    )


async def grpc_stream(
    client: LoomClient,
    r: Received,
    *,
    cancel_after: int | None = None,
    first_chunk: asyncio.Event | None = None,
    timeout_s: float = 120.0,
    **fields: Any,
) -> Received:
    """Stream ``r``'s request over gRPC, recording every chunk; ``cancel_after`` tokens, cancel the call.
    A task running this may be cancelled at any point: the call is cancelled with it."""
    call = client.generate_call(grpc_request(r, **fields), timeout=timeout_s)
    try:
        async for chunk in call:
            r.token_ids += chunk.token_ids
            r.tokens += len(chunk.token_ids)
            r.text += chunk.text
            if first_chunk is not None:
                first_chunk.set()
            if chunk.finish_reason:
                r.finish_reason = pb.FinishReason.Name(chunk.finish_reason)
                r.usage_completion = chunk.usage.completion_tokens
            elif cancel_after is not None and r.tokens >= cancel_after:
                r.cancelled = True
                r.code = "CANCELLED"
                call.cancel()
                break
    except grpc.aio.AioRpcError as err:
        r.code, r.message = err.code().name, err.details() or ""
    except asyncio.CancelledError:
        r.cancelled, r.code = True, "CANCELLED"
        call.cancel()
        raise
    return r


async def http_stream(
    http: httpx.AsyncClient,
    key: str,
    r: Received,
    *,
    cancel_after: int | None = None,
    **fields: Any,
) -> Received:
    """Stream ``r``'s request over the OpenAI-compatible front (``/v1/completions``, server-sent
    events, a log-probability per token so that tokens can be counted); ``cancel_after`` tokens, drop
    the connection. A task running this may be cancelled at any point: the connection drops with it."""
    r.front = "http"
    body = {
        "model": r.model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
        "request_id": r.request_id,
        **fields,
    }
    headers = {"authorization": f"Bearer {key}"}
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                r.code = str(response.status_code)
                r.message = (await response.aread()).decode(errors="replace")
                return r
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    r.code, r.message = str(event["error"].get("code")), event["error"].get("message", "")
                    continue
                if event.get("usage"):
                    r.usage_completion = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():
                    r.text += choice["text"]
                    r.tokens += len((choice.get("logprobs") or {}).get("tokens") or ())
                    if choice.get("finish_reason"):
                        r.finish_reason = choice["finish_reason"]
                if cancel_after is not None and r.tokens >= cancel_after and not r.finished:
                    r.cancelled, r.code = True, "CANCELLED"
                    break  # leaving the block closes the connection mid-stream
    except asyncio.CancelledError:
        r.cancelled, r.code = True, "CANCELLED"
        raise
    except httpx.HTTPError as err:
        r.code, r.message = "transport", str(err)
    return r


# ---- the greedy reference ------------------------------------------------------------------------


Outputs = dict[tuple[str, int], tuple[list[int], str]]  # (prompt, max_tokens) -> (token ids, text)


def check_streams(received: Sequence[Received], outputs: Outputs) -> list[str]:
    """What is wrong with these streams, against uninterrupted greedy runs of the same requests: a
    completed one must equal its run token for token (gRPC) or character for character and by count
    (HTTP); one its client cut must be its beginning."""
    problems = []
    for r in received:
        want_ids, want_text = outputs[(r.prompt, r.max_tokens)]
        if r.front == "grpc" and r.token_ids != want_ids[: len(r.token_ids)]:
            problems.append(f"{r.request_id}: tokens differ from the greedy run")
        if r.tokens > len(want_ids) or not want_text.startswith(r.text):
            problems.append(f"{r.request_id}: more or other text than the greedy run")
        if r.finished and r.code == "OK":
            if r.tokens != len(want_ids) or (r.front == "grpc" and r.token_ids != want_ids):
                problems.append(f"{r.request_id}: {r.tokens} tokens, the greedy run has {len(want_ids)}")
            if r.text != want_text:
                problems.append(f"{r.request_id}: final text differs from the greedy run's")
            if r.usage_completion != r.tokens:
                problems.append(f"{r.request_id}: usage says {r.usage_completion}, received {r.tokens}")
    return problems


class GreedyReference:
    """Greedy outputs of raw prompts from the engine in this process, on the same weights: what an
    uninterrupted stream must deliver. Outputs are computed in batches and kept by (prompt, max_tokens).
    """

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = LLMEngine(
            EngineConfig(
                model_path=str(model_dir), block_size=8, num_blocks=4096, max_num_seqs=64, num_threads=1
            )
        )
        self.outputs: Outputs = {}

    def compute(self, wanted: Iterable[tuple[str, int]]) -> None:
        missing = sorted({w for w in wanted if w not in self.outputs})
        for start in range(0, len(missing), 64):
            batch = {f"ref-{i}": w for i, w in enumerate(missing[start : start + 64])}
            outs = self.engine.run_to_completion(
                [
                    GenerationRequest(rid, self.tokenizer.encode(p), SamplingParams(max_tokens=n))
                    for rid, (p, n) in batch.items()
                ]
            )
            for rid, w in batch.items():
                self.outputs[w] = (list(outs[rid].token_ids), outs[rid].text)

    def check(self, received: Sequence[Received]) -> list[str]:
        self.compute((r.prompt, r.max_tokens) for r in received)
        return check_streams(received, self.outputs)


async def served_reference(client: LoomClient, model: str, wanted: Iterable[tuple[str, int]]) -> Outputs:
    """Greedy outputs from clean, uninterrupted requests through a gateway: the reference when the
    model's weights are not at hand (a server someone else started)."""
    outputs: Outputs = {}
    for prompt, n in sorted(set(wanted)):
        r = await grpc_stream(client, Received("reference", prompt, n, model=model))
        if r.code != "OK" or not r.finished:
            raise RuntimeError(f"the reference request for {prompt!r} failed: {r.code} {r.message}")
        outputs[(prompt, n)] = (r.token_ids, r.text)
    return outputs
