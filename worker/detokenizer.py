"""Incremental detokenization that never splits a UTF-8 character, with stop-string handling.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a tail yields
U+FFFD. Text is therefore released only once it decodes cleanly. Stop strings can straddle deltas, so
the last ``len(longest stop) - 1`` characters are held back until they cannot begin a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.tokenizer import Tokenizer

_PROMPT_CONTEXT = 4  # prompt tokens decoded with the first outputs, so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all text produced so far (truncated at a stop string)
        self._emitted = 0  # characters of ``text`` already handed out
        self.stopped = False

    def _decode_new(self) -> str:
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text that may be streamed now."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        new = self._decode_new()
        if new:
            start = max(0, len(self.text) - self._hold)
            self.text += new
            self._check_stop(start)
        return self._release(final=self.stopped)

    def _check_stop(self, search_from: int) -> None:
        cut = -1
        for s in self._stop:
            i = self.text.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.text = self.text[:cut]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def flush(self) -> str:
        """Release what is still held back; an incomplete final character decodes as U+FFFD."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._tok.decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix):
                start = max(0, len(self.text) - self._hold)
                self.text += full[len(prefix) :]
                self._read_offset = len(self._ids)
                self._check_stop(start)
        return self._release(final=True)
