"""Proposers: cheap guesses of a sequence's next tokens, which one forward step then verifies.

A proposal costs a verification slot in the step whether it is right or not, so a proposer says
nothing rather than guess blindly. Prompt lookup (``NgramProposer``) needs no model: input-grounded
work (summaries, extraction, edits, quoting) repeats spans of its context, and the tokens that
followed the latest earlier occurrence of the sequence's last n tokens are a good guess of what comes
next. A draft model (a smaller model of the same tokenizer) fits the same interface.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

from worker.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        """For each of ``seqs``, up to ``room[i]`` guesses of the tokens after its ``token_ids``
        (none: no guess). All rows at once, so a draft model runs them as one batch."""
        ...


@dataclass
class _Index:
    """Where each n-gram of a sequence last ended (the position after it), built up as it grows."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    upto: int = 0  # n-grams ending before this position are indexed


class NgramProposer:
    """Prompt lookup: the longest suffix of ``min_n``..``max_n`` tokens found earlier in the sequence
    (its prompt or output) proposes the tokens that followed that occurrence, the latest one first.

    Each sequence keeps an index of its n-grams, extended by the tokens added since the last call,
    so a proposal costs a dictionary lookup per suffix length however long the context is.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._index: weakref.WeakKeyDictionary[Sequence, _Index] = weakref.WeakKeyDictionary()

    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        return [self.guess(seq, n) for seq, n in zip(seqs, room, strict=True)]

    def guess(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest longest match of ``seq``'s suffix."""
        tokens = seq.token_ids
        if max_tokens <= 0 or len(tokens) <= self.min_n:
            return []
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = _Index()
        last = len(tokens) - 1  # the suffix itself ends at len(tokens): index only earlier endings
        for end in range(max(index.upto, 1), last + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(tokens[end - n : end])] = end
        index.upto = max(index.upto, last + 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            at = index.ends.get(tuple(tokens[-n:]))
            if at is not None:
                # What followed the match runs up to the end: the sequence then repeats with period
                # len(tokens) - at, and the guess goes on around that loop.
                guess = tokens[at : at + max_tokens]
                while len(guess) < max_tokens:
                    guess += tokens[at : at + max_tokens - len(guess)]
                return guess
        return []
