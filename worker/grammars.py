"""Each constrained sequence's grammar matcher: built off the engine thread, asked for the step's token
masks, advanced by the tokens sampled.

Building a grammar is the one costly part (milliseconds, more for a large schema), so it runs on this
table's own thread while the sequence waits at the scheduler's gate (as a LoRA adapter's load does);
the engine thread never builds one. A built grammar is kept per tenant and digest (a tenant's later
requests copy it; no tenant can tell from timing what another tenant's requests asked for).

A matcher lives as long as its sequence: preemption and recompute leave it where it is (the tokens it
consumed are still the sequence's), and a resumed stream's matcher consumes the delivered tokens
before the sequence runs. A matcher that fails (a grammar past its fuel limits, a token it refuses)
fails its own row, never the step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from protocol.structured import Constraint, error_summary, grammar_tokenizer, new_matcher
from protocol.tokenizer import Tokenizer
from worker.scheduler import Gate
from worker.sequence import Sequence

log = logging.getLogger(__name__)

_KEPT_GRAMMARS = 128  # built grammars kept for reuse (each a few hundred KB at most)


@dataclass(frozen=True)
class StepMasks:
    """The token masks of a step's constrained rows: ``rows[i]``'s allowed tokens are the set bits of
    ``bitmask[i]`` (bit b of word w: token 32 * w + b)."""

    rows: torch.Tensor  # int64 [k]: rows of the step's logits
    bitmask: torch.Tensor  # int32 [k, ceil(vocab / 32)]
    failed: list[tuple[int, str]]  # rows (of the logits) whose grammar failed, and why


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, parallel: bool = False) -> None:
        self._tokenizer = tokenizer
        # Masks are filled on llguidance's threads only where the cores are otherwise idle (the
        # forward pass runs on a GPU). On a CPU engine, the forward's own threads use every core:
        # other threads filling masks only contend with them (measured at batch 32 on 2 cores:
        # +8.3% step time with llguidance's pool, +5.1% on the engine thread).
        self._parallel = parallel
        self.vocab_size = vocab_size
        self._lltokenizer: Any = None  # built on the first constrained request (0.2 s)
        self._lock = threading.Lock()  # the build thread and the engine thread share the tables below
        self._built: OrderedDict[tuple[str, str], Any] = OrderedDict()  # pristine matchers, LRU
        self._builds: dict[tuple[str, str], concurrent.futures.Future[Any]] = {}
        self._matchers: weakref.WeakKeyDictionary[Sequence, Any] = weakref.WeakKeyDictionary()
        self._failed: weakref.WeakKeyDictionary[Sequence, str] = weakref.WeakKeyDictionary()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-grammar")
        self._executor: Any = None
        self.on_ready: Callable[[], None] = lambda: None  # wakes an engine that waits on a build
        self.build_seconds: list[float] = []  # per grammar built, for benchmarks

    # ---- the scheduler's gate ------------------------------------------------------------------

    def admit(self, seq: Sequence) -> Gate:
        constraint = seq.sampling.constraint
        if constraint is None or seq in self._matchers:
            return Gate.READY
        if seq in self._failed:
            return Gate.FAILED
        key = (seq.tenant, constraint.digest())
        with self._lock:
            pristine = self._built.get(key)
            if pristine is not None:
                self._built.move_to_end(key)
            elif key not in self._builds:
                self._builds[key] = self._pool.submit(self._build, key, constraint)
            build = self._builds.get(key)
        if pristine is None:
            assert build is not None
            if not build.done():
                return Gate.WAIT
            pristine = build.result()
        return self._start(seq, pristine)

    def release(self, seq: Sequence) -> None:
        return None  # a matcher outlives preemption; it goes with its sequence

    def failure(self, seq: Sequence) -> str | None:
        return self._failed.get(seq)

    def is_own_fault(self, seq: Sequence) -> bool:
        """Whether ``seq``'s grammar failed it (it could not be built, ran past its fuel, refused a
        token): the request's own constraint, not the replica, is at fault."""
        matcher = self._matchers.get(seq)
        return seq in self._failed or (matcher is not None and matcher.is_error())

    # ---- building ------------------------------------------------------------------------------

    def _build(self, key: tuple[str, str], constraint: Constraint) -> Any:
        started = time.perf_counter()
        try:
            if self._lltokenizer is None:
                self._lltokenizer = grammar_tokenizer(self._tokenizer, self.vocab_size)
            try:
                matcher = new_matcher(constraint, self._lltokenizer)
            except ValueError as exc:
                matcher = _Broken(str(exc))
            self.build_seconds.append(time.perf_counter() - started)
            with self._lock:
                # A grammar that cannot be built is kept too: the verdict is deterministic, and
                # forgetting it would build it again for every admission attempt.
                self._builds.pop(key, None)
                self._built[key] = matcher
                while len(self._built) > _KEPT_GRAMMARS:
                    self._built.popitem(last=False)
            return matcher
        finally:
            self.on_ready()

    def _start(self, seq: Sequence, pristine: Any) -> Gate:
        """``seq``'s own matcher, a copy of the built one; a resumed stream's consumes the output its
        earlier attempt delivered (the last prompt tokens past the original prompt)."""
        if pristine.is_error():
            self._failed[seq] = f"the output constraint cannot be used: {error_summary(pristine.get_error())}"
            return Gate.FAILED
        matcher = pristine.deep_copy()
        generated = seq.token_ids[seq.num_prompt_tokens - seq.num_resumed_tokens :]
        if generated and not matcher.consume_tokens(generated):
            self._failed[seq] = "the output so far does not match the request's constraint"
            return Gate.FAILED
        self._matchers[seq] = matcher
        return Gate.READY

    # ---- the step ------------------------------------------------------------------------------

    def masks(self, seqs: list[Sequence]) -> StepMasks | None:
        """The masks for the rows of ``seqs`` (a step's sampled rows, in order) that are constrained;
        None when none is. A matcher is asked once per row."""
        rows = [(i, self._matchers.get(s)) for i, s in enumerate(seqs) if s.sampling.constraint is not None]
        if not rows:
            return None
        from llguidance import LLExecutor
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        live = [(m, j) for j, (_, m) in enumerate(rows) if m is not None and not m.is_error()]
        failed: list[tuple[int, str]] = []
        if live and self._parallel:
            if self._executor is None:
                self._executor = LLExecutor()
            fill_next_token_bitmask_par(self._executor, live, bitmask)
        else:
            for matcher, j in live:
                fill_next_token_bitmask(matcher, bitmask, j)
        for i, m in rows:
            if m is None:
                failed.append((i, "the output constraint was never started"))
            elif m.is_error():
                failed.append((i, f"the output constraint failed: {error_summary(m.get_error())}"))
        return StepMasks(torch.tensor([i for i, _ in rows], dtype=torch.long), bitmask, failed)

    def advance(self, sampled: dict[Sequence, int]) -> list[tuple[Sequence, str]]:
        """Feed each constrained sequence the token it was given; those whose matcher refused it."""
        refused: list[tuple[Sequence, str]] = []
        for seq, token in sampled.items():
            matcher = self._matchers.get(seq)
            if matcher is None or seq.finish_reason is not None:
                continue
            if not matcher.consume_token(token):
                refused.append((seq, f"the output constraint failed: {error_summary(matcher.get_error())}"))
        return refused


class _Broken:
    """Stands for a grammar that could not even be written (a schema that is not JSON)."""

    def __init__(self, error: str) -> None:
        self._error = error

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return self._error
