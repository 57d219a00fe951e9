"""A stream resumed on another replica continues its text exactly where the lost one stopped.

The output processor is fed a scripted token stream (the byte tokenizer: one token per byte, so cuts
fall inside multi-byte characters) and cut at every position: what the first attempt delivered plus
what the continuation delivers must equal the uninterrupted stream, character for character, with
stop strings honoured across the cut.
"""

from __future__ import annotations

import pytest

from loadtest.tiny_model import byte_tokenizer
from protocol.requests import FinishReason, GenerationRequest, SamplingParams
from worker.output_processor import OutputProcessor
from worker.scheduler import SequenceUpdate
from worker.sequence import Sequence

PROMPT = "Q: say it\nA: "


class _Scheduler:
    """The scheduler calls the output processor makes: ending a sequence on a stop string, and
    forgetting tokens gained after it (none here: one token a step)."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, FinishReason]] = []

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.finished.append((seq.request_id, reason))

    def drop_last_tokens(self, seq: Sequence, count: int) -> None:
        assert count == 0


def _run(tokens: list[int], stop: tuple[str, ...], delivered: list[int] | None = None) -> tuple[str, bool]:
    """Feed ``tokens`` (after ``delivered``, a resumed stream's earlier output); returns the text released
    and whether a stop string ended it."""
    tok = byte_tokenizer()
    prompt = tok.encode(PROMPT) + (delivered or [])
    req = GenerationRequest(
        "r", prompt, SamplingParams(max_tokens=999, stop=stop), num_resumed_tokens=len(delivered or [])
    )
    seq = Sequence.from_request(req)
    processor, scheduler = OutputProcessor(tok), _Scheduler()
    processor.add(seq, req.num_resumed_tokens)
    text = ""
    for i, t in enumerate(tokens):
        seq.token_ids.append(t)
        last = i == len(tokens) - 1
        update = SequenceUpdate(seq, (t,), FinishReason.LENGTH if last else None)
        for out in processor.process([update], {}, scheduler):  # type: ignore[arg-type]
            text += out.text
        if scheduler.finished:
            return text, True
    return text, False


def _delivered_before(tokens: list[int], stop: tuple[str, ...], cut: int) -> str:
    """What the first attempt had streamed when it was lost after ``cut`` tokens."""
    tok = byte_tokenizer()
    req = GenerationRequest("r", tok.encode(PROMPT), SamplingParams(max_tokens=999, stop=stop))
    seq = Sequence.from_request(req)
    processor = OutputProcessor(tok)
    processor.add(seq)
    text = ""
    for t in tokens[:cut]:
        seq.token_ids.append(t)
        outs = processor.process([SequenceUpdate(seq, (t,), None)], {}, _Scheduler())  # type: ignore[arg-type]
        text += "".join(o.text for o in outs)
        if any(o.finished for o in outs):
            break
    return text


@pytest.mark.parametrize(
    ("answer", "stop"),
    [
        ("The loom weaves a long cloth of blue and gold.", ()),
        ("织布机织出蓝色和金色的长布。", ()),
        ("Looms 🧵🪡 weave 🎉 with ✨ emoji 👩‍👩‍👧", ()),
        ("Weave the warp, then STOP here and nothing after", ("STOP",)),
        ("织布机 <end> 之后", ("<end>",)),
        ("emoji 🎉 then 🛑🛑 stop", ("🛑🛑",)),
    ],
)
def test_a_resumed_stream_equals_the_uninterrupted_one_at_every_cut(
    answer: str, stop: tuple[str, ...]
) -> None:
    tokens = byte_tokenizer().encode(answer)
    whole, whole_stopped = _run(tokens, stop)
    assert whole == (answer.split(stop[0])[0] if stop else answer)
    for cut in range(1, len(tokens)):
        before = _delivered_before(tokens, stop, cut)
        if whole_stopped and cut >= len(byte_tokenizer().encode(answer.split(stop[0])[0] + stop[0])):
            continue  # the stop string was complete before the cut: the stream had ended there
        after, stopped = _run(tokens[cut:], stop, delivered=tokens[:cut])
        assert before + after == whole, f"cut after {cut} tokens"
        assert stopped == whole_stopped
