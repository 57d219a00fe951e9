"""Turns the scheduler's per-sequence updates into streamed deltas: text, stop strings, final counts.

Text is the one part of ending a request the scheduler cannot judge: a stop string may only appear
once tokens are detokenized, and text that could begin one is held back until it cannot. When a stop
string completes, this asks the scheduler to end the sequence (as vLLM's output processor aborts it).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.requests import FinishReason, RequestOutput, TokenLogprob
from protocol.tokenizer import Tokenizer
from worker.detokenizer import IncrementalDetokenizer
from worker.scheduler import Scheduler, SequenceUpdate
from worker.sequence import Sequence


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    emitted_tokens: int = 0  # output token ids already handed out
    logprobs: list[TokenLogprob] | None = None  # of the tokens not yet handed out, when asked for


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, seq: Sequence, num_resumed_tokens: int = 0) -> None:
        """Start ``seq``'s stream. A resumed stream replays the output its earlier attempt delivered,
        so the detokenizer is where it was at the cut: what it held back is still held, a character
        whose first bytes were delivered completes, a stop string spanning the cut is found."""
        cut = seq.num_tokens - num_resumed_tokens
        detok = IncrementalDetokenizer(self._tokenizer, seq.token_ids[:cut], seq.sampling.stop)
        for token in seq.token_ids[cut:]:
            detok.add(token)  # delivered already: its released text is not released again
        wants_logprobs = seq.sampling.logprobs is not None
        self._streams[seq.request_id] = _Stream(detok, logprobs=[] if wants_logprobs else None)

    def process(
        self,
        updates: list[SequenceUpdate],
        logprobs: dict[Sequence, list[TokenLogprob]],
        scheduler: Scheduler,
    ) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for u in updates:
            seq, stream = u.seq, self._streams[u.seq.request_id]
            reason = u.finish_reason
            text = ""
            for i, token in enumerate(u.tokens):
                if stream.logprobs is not None:
                    stream.logprobs.append(logprobs[seq][i])
                if token in seq.stop_token_ids:  # an end-of-sequence token has no text
                    continue
                text += stream.detok.add(token)
                if stream.detok.stopped:
                    if reason is None:
                        scheduler.finish(seq, FinishReason.STOP)
                    # Tokens gained after the stop string completed (proposals that held) are not
                    # output; the stop string ended it, even on its last token.
                    scheduler.drop_last_tokens(seq, len(u.tokens) - 1 - i)
                    reason = FinishReason.STOP
                    break
            new_ids = seq.output_token_ids[stream.emitted_tokens :]
            if reason is not None:
                outputs.append(self.final(seq, reason, text + stream.detok.flush(), new_ids))
            elif text or new_ids:
                stream.emitted_tokens += len(new_ids)
                outputs.append(_output(seq, text, new_ids, logprobs=_take(stream)))
        return outputs

    def final(
        self,
        seq: Sequence,
        reason: FinishReason,
        text: str = "",
        new_ids: list[int] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """The request's last delta; forgets its stream."""
        stream = self._streams.pop(seq.request_id, None)
        ids = new_ids or []
        logprobs = _take(stream) if stream is not None and ids else None
        return _output(seq, text, ids, reason, error, logprobs)


def _take(stream: _Stream) -> list[TokenLogprob] | None:
    """The logprobs of the tokens about to be handed out (all pending ones)."""
    if stream.logprobs is None:
        return None
    taken, stream.logprobs = stream.logprobs, []
    return taken


def _output(
    seq: Sequence,
    text: str,
    new_ids: list[int],
    reason: FinishReason | None = None,
    error: str | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> RequestOutput:
    return RequestOutput(
        seq.request_id,
        text,
        new_ids,
        finish_reason=reason,
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_output_tokens,
        cached_prompt_tokens=seq.num_cached_prompt_tokens,
        error=error,
        logprobs=logprobs,
    )
