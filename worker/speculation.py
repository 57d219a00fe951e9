"""Which rows speculate in a step, and how far: proposals worth more than the step time they cost.

Verifying a proposed token adds it to the step's batch. While a step is bound by reading the weights
that costs little, and every accepted token is a step saved for its row; once the step is bound by
compute, each verified token costs about as much as a decoded one and rejected ones are pure loss.
So the decision is a price: the engine fits its step time as ``base + per_token * tokens`` from its
own steps (``StepCost``), and a row's i-th proposed token is worth ``rate ** i`` expected tokens (its
acceptance rate so far). A token is proposed while what it is expected to yield beats what it costs
every row of the batch: ``rate ** i * step_time > tokens_out * per_token``. At batch 1 that admits
almost any proposal; in a large batch, only rows whose proposals keep being right; a row whose
guesses fail drops out by itself and recovers slowly to try again.

Only rows that opted in (``Sequence.speculative``), are decoding, and have no output constraint
propose (a grammar's mask is per position and known only once the previous token is chosen).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass

from protocol.stats import SpecCounts
from worker.proposer import Proposer
from worker.sequence import Sequence, SequenceStatus

PRIOR_RATE = 0.6  # a row's acceptance rate before it has verified anything
RATE_MEMORY = 0.7  # how much of the previous estimate each verification keeps
RECOVERY = 0.02  # per step without proposals, how far the estimate returns toward the prior


class StepCost:
    """Step time as ``base + per_token * tokens``, least squares over recent steps (older ones fade)."""

    def __init__(self, base: float = 0.025, per_token: float = 0.001, memory: float = 0.98) -> None:
        self.base, self.per_token, self.memory = base, per_token, memory
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        m = self.memory
        self._n = m * self._n + 1
        self._x = m * self._x + tokens
        self._y = m * self._y + seconds
        self._xx = m * self._xx + tokens * tokens
        self._xy = m * self._xy + tokens * seconds
        var = self._xx / self._n - (self._x / self._n) ** 2
        if var < 1.0:  # steps of one size say nothing about the slope: keep the last fit's
            return
        slope = (self._xy / self._n - self._x * self._y / self._n**2) / var
        if slope > 0:
            self.per_token = slope
            self.base = max(self._y / self._n - slope * self._x / self._n, 0.0)

    def seconds(self, tokens: int) -> float:
        return self.base + self.per_token * tokens


@dataclass
class _Row:
    rate: float = PRIOR_RATE


class Speculation:
    def __init__(self, proposer: Proposer, max_tokens: int, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.cost = StepCost()
        self.counts: dict[str, SpecCounts] = defaultdict(SpecCounts)  # per tenant, since start
        self._rows: weakref.WeakKeyDictionary[Sequence, _Row] = weakref.WeakKeyDictionary()

    def _row(self, seq: Sequence) -> _Row:
        row = self._rows.get(seq)
        if row is None:
            row = self._rows[seq] = _Row()
        return row

    def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """This step's proposals, by row (rows absent propose nothing)."""
        if self.max_tokens == 0:
            return {}
        decoding = [s for s in running if s.status is SequenceStatus.RUNNING and not s.is_prefilling]
        rows: list[Sequence] = []
        rooms: list[int] = []
        for seq in decoding:
            if not seq.speculative or seq.sampling.constraint is not None:
                continue
            # Never past the request's last token nor the context: the bonus token counts too.
            room = min(
                self.max_tokens,
                seq.sampling.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            if room > 0:
                rows.append(seq)
                rooms.append(room)
        guesses: list[tuple[Sequence, list[int], float]] = []
        for seq, guess in zip(rows, self.proposer.propose(rows, rooms), strict=True):
            row = self._row(seq)
            if guess:
                guesses.append((seq, guess, row.rate))
            else:
                row.rate += RECOVERY * (PRIOR_RATE - row.rate)
        if not guesses:
            return {}
        # Tokens of this step before any proposal: a decode each (prompt chunks come on top and only
        # make a proposal cheaper relative to the step, so leaving them out errs on the safe side).
        tokens = out = float(len(decoding))
        taken = {seq: 0 for seq, _, _ in guesses}
        # Every candidate token with its expected yield, best first; take while it pays.
        offers = sorted(
            ((rate ** (i + 1), seq) for seq, guess, rate in guesses for i in range(len(guess))),
            key=lambda o: -o[0],
        )
        for value, seq in offers:
            if value * self.cost.seconds(int(tokens)) <= out * self.cost.per_token:
                break
            taken[seq] += 1
            tokens += 1
            out += value
        proposals = {}
        for seq, guess, _ in guesses:
            if taken[seq]:
                proposals[seq] = guess[: taken[seq]]
            else:
                row = self._rows[seq]
                row.rate += RECOVERY * (PRIOR_RATE - row.rate)
        return proposals

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A row verified ``proposed`` tokens and ``accepted`` of them held."""
        row = self._row(seq)
        row.rate = RATE_MEMORY * row.rate + (1 - RATE_MEMORY) * (accepted / proposed)
        c = self.counts[seq.tenant]
        c.drafts += 1
        c.draft_tokens += proposed
        c.accepted_tokens += accepted
