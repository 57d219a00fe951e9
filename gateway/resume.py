"""Carry a stream across the loss of its engine replica.

When a replica dies after some tokens were streamed, the request continues on another replica (or on
its replacement): the continuation's prompt is the original prompt plus every token delivered so far,
and it may generate only what remains of ``max_tokens``. The client sees one uninterrupted stream with
cumulative counts. Greedy requests continue exactly as they would have; a seeded sampled request
continues with a seed derived from its own, so a retry of the whole request still reproduces it.

Text the lost replica had decoded but was still holding back (the tail of a possible stop string, or
bytes of an unfinished character) is recovered by decoding the delivered tokens here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator

from gateway.pools import EnginePool, WorkerLostError
from worker.api import GenerationRequest, RequestOutput, Tokenizer

log = logging.getLogger(__name__)

MAX_RESUMES = 2


async def resumable_stream(
    pool: EnginePool, request: GenerationRequest, tokenizer: Tokenizer, max_resumes: int = MAX_RESUMES
) -> AsyncGenerator[RequestOutput, None]:
    delivered: list[int] = []
    text = ""
    cached = 0
    current = request
    for attempt in range(max_resumes + 1):
        try:
            # Closing this stream closes the pool's at once, which stops the request in the engine.
            async with contextlib.aclosing(pool.generate(current)) as outputs:
                async for out in outputs:
                    if attempt == 0:
                        cached = out.cached_prompt_tokens
                    delivered += out.token_ids
                    text += out.text
                    out.prompt_tokens = len(request.prompt_token_ids)
                    out.completion_tokens = len(delivered)
                    out.cached_prompt_tokens = cached
                    yield out
            return
        except WorkerLostError:
            remaining = request.sampling.max_tokens - len(delivered)
            if attempt == max_resumes or not delivered or remaining <= 0:
                raise
            log.warning(
                "request %s lost its replica after %d tokens; resuming (%d/%d)",
                request.request_id,
                len(delivered),
                attempt + 1,
                max_resumes,
            )
        # An unfinished character at the cut is left for the continuation, whose prompt holds its bytes.
        held = tokenizer.decode(delivered)[len(text) :].rstrip("\ufffd")
        if held:  # streamed now, so the continuation can pick up exactly where the text stopped
            text += held
            yield RequestOutput(
                request.request_id,
                held,
                [],
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=len(delivered),
                cached_prompt_tokens=cached,
            )
        seed = request.sampling.seed
        sampling = dataclasses.replace(
            request.sampling,
            max_tokens=remaining,
            seed=None if seed is None else (seed * 1_000_003 + len(delivered)) % 2**63,
        )
        current = dataclasses.replace(
            request,
            request_id=f"{request.request_id}#resume{attempt + 1}",
            prompt_token_ids=[*request.prompt_token_ids, *delivered],
            sampling=sampling,
        )
