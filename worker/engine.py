"""The synchronous engine core: requests in, one step at a time, deltas out.

A step is four verbs: the scheduler schedules, the model runner executes, the scheduler updates its
sequences from the step's output, and the output processor emits deltas. ``LLMEngine`` owns the
pieces and is driven by one thread (``AsyncEngine`` runs it in the background for asyncio callers).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from common import Priority
from protocol.engine_config import EngineConfig
from protocol.model_info import ModelInfo
from protocol.requests import (
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
    TokenLogprob,
)
from protocol.stats import EngineStats
from protocol.structured import size_violations
from worker.block_manager import BlockManager
from worker.checkpoint import Checkpoint, load_checkpoint
from worker.device import kv_budget_bytes, resolved_device, resolved_dtype
from worker.draft_proposer import DraftProposer
from worker.engine_counters import EngineCounters
from worker.fair_share import ServiceCosts
from worker.grammars import Grammars
from worker.kv_cache import KVCache, blocks_for_budget
from worker.lora_slots import LoraSlots
from worker.model import LlamaModel
from worker.model_runner import ModelRunner, StepOutput
from worker.output_processor import OutputProcessor
from worker.proposer import NgramProposer, Proposer
from worker.scheduler import GateChain, ScheduledBatch, SchedulerConfig, scheduler_class
from worker.sequence import Sequence
from worker.speculation import Speculation
from worker.step_trace import StepObserver, StepRow, StepTrace

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        checkpoint: Checkpoint | None = None,
        draft: Checkpoint | None = None,
    ) -> None:
        """``draft``: the draft model's checkpoint, if given in code (else from
        ``config.speculative_draft_model``)."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        ckpt = checkpoint or load_checkpoint(config.model_path, config.model_name)
        self.model_name = config.model_name or ckpt.name
        self.tokenizer = ckpt.tokenizer
        self.model_config = ckpt.config
        self.device = resolved_device(config)
        self.dtype = resolved_dtype(config, self.device)
        self.model = LlamaModel(ckpt.config, ckpt.weights, self.dtype, self.device)

        num_blocks = config.num_blocks or blocks_for_budget(
            ckpt.config, config.block_size, self.dtype, kv_budget_bytes(config, self.device)
        )
        self.kv_cache = KVCache.allocate(ckpt.config, num_blocks, config.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_model_len = min(
            config.max_model_len or ckpt.config.max_position_embeddings, self.block_manager.capacity_tokens
        )
        self.lora = (
            LoraSlots(ckpt.config, config.max_loras, config.max_lora_rank, self.dtype, self.device)
            if config.max_loras
            else None
        )
        # Grammars first: a sequence waiting on its grammar must not hold an adapter slot meanwhile.
        self.grammars = Grammars(ckpt.tokenizer, ckpt.config.vocab_size, parallel=self.device.type == "cuda")
        self.scheduler = scheduler_class(config.scheduler_cls)(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                config.priority_scheduling,
                ServiceCosts(config.fair_prefill_cost, config.fair_decode_cost),
                config.preemption_limit,
            ),
            self.block_manager,
            gate=GateChain(self.grammars, self.lora) if self.lora is not None else self.grammars,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.lora, self.grammars)
        self.speculation = Speculation(self._proposer(draft), config.speculative_tokens, self.max_model_len)
        self.outputs = OutputProcessor(ckpt.tokenizer)
        self.eos_token_ids = frozenset(ckpt.tokenizer.eos_token_ids) | frozenset(ckpt.config.eos_token_ids)
        self.counters = EngineCounters(step_budget=config.max_num_batched_tokens)
        # Set by whatever may unblock a stalled step: an adapter load that finished, a driver's command.
        self.wakeup = threading.Event()
        self._stalled = False
        self._observers: list[StepObserver] = []
        self._failed_run = 0  # steps in a row in which no row could run
        self._failed_run_tenants: set[str] = set()  # whose rows failed in them
        if self.lora is not None:
            self.lora.on_loaded = self.wakeup.set
        self.grammars.on_ready = self.wakeup.set
        self._weight_bytes = self.model.weight_bytes()
        self._kv_bytes_per_token = self.kv_cache.bytes_per_token()

    def _proposer(self, draft: Checkpoint | None) -> Proposer:
        """Prompt lookup, or the draft model when one is configured (same vocabulary, or refused)."""
        config = self.config
        if draft is None and config.speculative_draft_model is None:
            return NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
        draft = draft or load_checkpoint(config.speculative_draft_model)
        if draft.config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"speculative_draft_model: its vocabulary has {draft.config.vocab_size} tokens, the "
                f"model's {self.model_config.vocab_size}: a draft must share the model's tokenizer"
            )
        return DraftProposer(draft, self.block_manager.num_blocks, config.block_size, self.dtype, self.device)

    # ---- requests ------------------------------------------------------------------------------

    def validate(self, req: GenerationRequest) -> None:
        """Raise InvalidRequestError (naming the field) for a request this engine cannot serve."""
        n = len(req.prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{n} prompt tokens leave no room in this model's context of {self.max_model_len} tokens",
            )
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in req.prompt_token_ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")
        if req.adapter is not None and self.lora is None:
            raise InvalidRequestError("model", "this replica serves no LoRA adapters (max_loras is 0)")
        if req.sampling.constraint is not None and (bad := size_violations(req.sampling.constraint)):
            raise InvalidRequestError(*bad[0])

    def add_request(self, req: GenerationRequest) -> None:
        self.validate(req)
        seq = Sequence.from_request(req, self.eos_token_ids)
        self.scheduler.add(seq)
        self.outputs.add(seq, req.num_resumed_tokens)
        self.counters.prompt_tokens += seq.num_prompt_tokens

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or None if unknown."""
        seq = self.scheduler.get(request_id)
        return None if seq is None else self._end(seq, reason)

    def _end(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        return self._final(seq, reason, error)

    def _final(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> RequestOutput:
        self.counters.finished += 1
        out = self.outputs.final(seq, reason, error=error)
        out.request_fault = reason is FinishReason.ERROR and self.grammars.is_own_fault(seq)
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.request_ids()

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update, emit. Every request that ends in it is counted
        once as finished, whichever way it ended."""
        started = time.perf_counter()
        batch = self.scheduler.schedule(self.speculation.propose(self.scheduler.running))
        scheduled = time.perf_counter()
        rows = _rows(batch) if self._observers and batch else ()
        rejected = [
            self._final(seq, FinishReason.ERROR, reason) for seq, reason in self.scheduler.take_rejected()
        ]
        self._stalled = not batch and not rejected and self.scheduler.has_work()
        if not batch:
            return rejected
        t0 = time.monotonic()
        try:
            parts: list[tuple[ScheduledBatch, StepOutput]] = [(batch, self.runner.execute(batch))]
            culprits: list[tuple[Sequence, str]] = []
        except Exception:  # a failed forward fails the requests that cause it, never the engine
            log.exception(
                "forward step of %d requests failed; finding the ones that fail it", len(batch.seqs)
            )
            parts, culprits = self._split(batch)
        ended = [self._end(seq, FinishReason.ERROR, error) for seq, error in culprits if seq.is_live]
        if not parts:
            self._count_failed_step({seq.tenant for seq, _ in culprits})
            return rejected + ended
        self._failed_run, self._failed_run_tenants = 0, set()
        t1 = time.monotonic()
        self.counters.record_step(t0, t1, batch, self._step_bytes(batch))
        self.speculation.cost.record(batch.total_tokens, t1 - t0)
        forward_s = grammar_s = 0.0
        for part, result in parts:
            forward_s += result.forward_s
            grammar_s += result.grammar_s
            # A row that got no token (non-finite logits, a sampling error, a grammar that failed), or
            # whose grammar refused its token, fails its own request only.
            for seq, reason in self.grammars.advance(result.sampled):
                del result.sampled[seq]
                result.failed.append((seq, reason))
            ended += [
                self._end(seq, FinishReason.ERROR, f"{reason}; it was stopped (others were not)")
                for seq, reason in result.failed
                if seq.is_live
            ]
            for seq in result.sampled:
                if (spec := part.spec.get(seq)) is not None:
                    self.speculation.record(seq, len(spec), len(result.accepted.get(seq, ())))
            updates = self.scheduler.update_from_output(part, result.sampled, result.accepted)
            emitted = self.outputs.process(updates, result.logprobs, self.scheduler)
            self.counters.generated_tokens += sum(len(u.tokens) for u in updates)
            self.counters.finished += sum(1 for o in emitted if o.finished)
            ended += emitted
        if self._observers:
            trace = StepTrace(rows, scheduled - started, forward_s, time.perf_counter() - started, grammar_s)
            for observe in self._observers:
                observe(trace)
        return rejected + ended

    def _count_failed_step(self, tenants: set[str]) -> None:
        """A step in which no row could run. It counts toward the replica's health (consecutive failed
        steps, which make it unhealthy) only once the failing rows of this run of failed steps belong
        to two tenants or more: requests of one tenant failing however often are that tenant's
        failure, and must not get a replica replaced under everyone else."""
        self._failed_run += 1
        self._failed_run_tenants |= tenants
        if len(self._failed_run_tenants) > 1:
            self.counters.consecutive_failed_steps = self._failed_run

    def _split(
        self, batch: ScheduledBatch
    ) -> tuple[list[tuple[ScheduledBatch, StepOutput]], list[tuple[Sequence, str]]]:
        """A failed step, run again in halves (each half again, while it fails) until the rows that
        fail alone are found: the parts that ran with their results, and each culprit with its error.

        Re-running is safe: the scheduler's state moves only when a result is applied, and a row's K/V
        is written to the same slots with the same values. The innocent rows lose nothing but time.
        """
        if len(batch.seqs) == 1:
            try:
                return [(batch, self.runner.execute(batch))], []
            except Exception as exc:
                return [], [(batch.seqs[0], f"{type(exc).__name__}: {exc}; it was stopped (others were not)")]
        mid = len(batch.seqs) // 2
        parts: list[tuple[ScheduledBatch, StepOutput]] = []
        culprits: list[tuple[Sequence, str]] = []
        for half in (
            ScheduledBatch(batch.seqs[:mid], batch.num_tokens[:mid], spec=batch.spec),
            ScheduledBatch(batch.seqs[mid:], batch.num_tokens[mid:], spec=batch.spec),
        ):
            try:
                parts.append((half, self.runner.execute(half)))
            except Exception:
                more, bad = self._split(half)
                parts += more
                culprits += bad
        return parts, culprits

    def add_step_observer(self, observer: StepObserver) -> Callable[[], None]:
        """Call ``observer`` with a :class:`StepTrace` after every step that ran a batch to its end;
        returns what removes it again."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    def stalled(self) -> bool:
        """The last step ran nothing although requests wait: they wait on a resource (an adapter being
        read). A driver then waits in :meth:`wait_for_progress` instead of spinning."""
        return self._stalled

    def wait_for_progress(self, timeout: float | None = None) -> None:
        """Block until something may let a waiting request run (an adapter load finished) or a caller
        sets :attr:`wakeup` (a new request, an abort), at most ``timeout`` seconds."""
        self.wakeup.wait(timeout)
        self.wakeup.clear()

    # ---- stats ---------------------------------------------------------------------------------

    def _step_bytes(self, batch: ScheduledBatch) -> int:
        """What a step must move at least: every weight once, the K/V it reads and the K/V it writes."""
        kv_read = sum(
            seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
        )
        return self._weight_bytes + (kv_read + batch.total_tokens) * self._kv_bytes_per_token

    def stats(self) -> EngineStats:
        stats = self.counters.snapshot(self.scheduler, self.block_manager, self.lora)
        counts = {t: dataclasses.replace(c) for t, c in self.speculation.counts.items()}
        return dataclasses.replace(stats, speculation=counts)

    def fair_service(self) -> dict[tuple[Priority, str], float]:
        """Weighted service given here per (class, tenant), cumulative: the pool's ledger sums it
        (safe from another thread: a copy under the interpreter's lock)."""
        return self.scheduler.fair.served()

    def set_remote_service(self, served: dict[tuple[Priority, str], float]) -> None:
        """What the pool's other replicas gave each (class, tenant): counted in the fair share."""
        self.scheduler.fair.set_remote(served)

    def model_info(self, pool: str = "") -> ModelInfo:
        return ModelInfo(
            model=self.model_name,
            context_length=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            pool=pool,
            device=str(self.device),
            pid=os.getpid(),
        )

    # ---- offline convenience -------------------------------------------------------------------

    def run_to_completion(self, requests: list[GenerationRequest]) -> dict[str, RequestOutput]:
        """Serve ``requests`` (all admitted at once) and return each one's whole output."""
        for r in requests:
            self.add_request(r)
        return self.drain()

    def drain(self) -> dict[str, RequestOutput]:
        """Step until idle; merge each request's deltas into one output."""
        merged: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                merge_output(merged, out)
            if self.stalled():
                self.wait_for_progress(timeout=1.0)
        return merged


def _rows(batch: ScheduledBatch) -> tuple[StepRow, ...]:
    return tuple(
        StepRow(
            n, s.num_computed_tokens, s.num_computed_tokens + n == s.num_tokens + len(batch.spec.get(s, ()))
        )
        for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
    )


def merge_output(acc: dict[str, RequestOutput], out: RequestOutput) -> None:
    """Fold a delta into the running total for its request."""
    prev = acc.get(out.request_id)
    if prev is None:
        acc[out.request_id] = RequestOutput(
            **{**out.__dict__, "token_ids": list(out.token_ids), "logprobs": _copy(out.logprobs)}
        )
        return
    prev.text += out.text
    prev.token_ids.extend(out.token_ids)
    prev.finish_reason = out.finish_reason
    prev.prompt_tokens = out.prompt_tokens
    prev.completion_tokens = out.completion_tokens
    prev.cached_prompt_tokens = out.cached_prompt_tokens
    prev.error = out.error
    prev.request_fault = out.request_fault
    if out.logprobs is not None:
        prev.logprobs = [*(prev.logprobs or []), *out.logprobs]


def _copy(items: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
    return None if items is None else list(items)
