"""Carry a stream across the loss of its engine replica.

When a replica dies after some tokens were streamed, the request continues on another replica (or on
its replacement): the continuation's prompt is the original prompt plus every token delivered so far,
and it may generate only what remains of ``max_tokens``. The client sees one uninterrupted stream with
cumulative counts. Greedy requests continue exactly as they would have; a seeded sampled request
continues with a seed derived from its own, so a retry of the whole request still reproduces it.

The continuation is told how many of its prompt tokens are delivered output (``num_resumed_tokens``),
so its engine picks up the text exactly where the lost one stopped: what was held back for a possible
stop string, a character whose first bytes were delivered, a stop string that spans the cut. A replica
lost after the stream's final delta is not resumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator

from gateway.engine_pool import EnginePool, WorkerLostError
from protocol.limits import LIMITS
from protocol.requests import GenerationRequest, RequestOutput

log = logging.getLogger(__name__)

MAX_RESUMES = 2


async def resumable_stream(
    pool: EnginePool, request: GenerationRequest, max_resumes: int = MAX_RESUMES
) -> AsyncGenerator[RequestOutput, None]:
    delivered: list[int] = []
    cached = 0
    current = request
    for attempt in range(max_resumes + 1):
        finished = False
        try:
            # Closing this stream closes the pool's at once, which stops the request in the engine.
            async with contextlib.aclosing(pool.generate(current)) as outputs:
                async for out in outputs:
                    if attempt == 0:
                        cached = out.cached_prompt_tokens
                    delivered += out.token_ids
                    out.prompt_tokens = len(request.prompt_token_ids)
                    out.completion_tokens = len(delivered)
                    out.cached_prompt_tokens = cached
                    finished = out.finished
                    yield out
            return
        except WorkerLostError:
            if finished:  # lost after its last delta: the stream is whole, there is nothing to resume
                return
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
        seed = request.sampling.seed
        sampling = dataclasses.replace(
            request.sampling,
            max_tokens=remaining,
            seed=None if seed is None else (seed * 1_000_003 + len(delivered)) % LIMITS.seed_bound,
        )
        current = dataclasses.replace(
            request,
            request_id=f"{request.request_id}#resume{attempt + 1}",
            prompt_token_ids=[*request.prompt_token_ids, *delivered],
            sampling=sampling,
            num_resumed_tokens=len(delivered),
        )
