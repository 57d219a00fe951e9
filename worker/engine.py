"""The synchronous engine core: requests in, one scheduled forward step at a time, deltas out.

``LLMEngine`` owns the model, the KV cache, the block manager and the scheduler, and is driven by one
thread (``AsyncEngine`` runs it in a background thread for asyncio callers).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from worker.block_manager import BlockManager
from worker.checkpoint import Checkpoint, load_checkpoint
from worker.detokenizer import IncrementalDetokenizer
from worker.kv_cache import KVCache, blocks_for_budget
from worker.model import LlamaModel
from worker.model_runner import ModelRunner
from worker.request import FinishReason, GenerationRequest, InvalidRequestError, Priority, RequestOutput
from worker.scheduler import Scheduler, SchedulerConfig, SchedulingMode
from worker.sequence import Sequence, SequenceStatus
from worker.stats import EngineStats

log = logging.getLogger(__name__)

_BUSY_WINDOW_S = 10.0


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # a .gguf file or a Hugging Face directory; None: the embedded model
    model_name: str | None = None
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu (bf16 is slower there)
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on cpu, 60% of free memory on cuda
    num_blocks: int | None = None  # overrides the memory budget
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    scheduling: SchedulingMode = SchedulingMode.CONTINUOUS
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None  # torch intra-op threads on cpu

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
                self.dtype
            ]
        except KeyError:
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, not {self.dtype!r}"
            ) from None


@dataclass
class _Stream:
    """Per-request output state kept beside the sequence."""

    detok: IncrementalDetokenizer
    emitted_tokens: int = 0


@dataclass
class _Counters:
    steps: int = 0
    step_tokens: int = 0
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    last_step_padding: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    busy: deque[tuple[float, float]] = field(default_factory=deque)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, checkpoint: Checkpoint | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        ckpt = checkpoint or load_checkpoint(config.model_path, config.model_name)
        self.model_name = config.model_name or ckpt.name
        self.tokenizer = ckpt.tokenizer
        self.model_config = ckpt.config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        self.model = LlamaModel(ckpt.config, ckpt.weights, self.dtype, self.device)

        num_blocks = config.num_blocks or blocks_for_budget(
            ckpt.config, config.block_size, self.dtype, self._kv_budget()
        )
        self.kv_cache = KVCache.allocate(ckpt.config, num_blocks, config.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.scheduling),
            self.block_manager,
        )
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.max_model_len = min(
            config.max_model_len or ckpt.config.max_position_embeddings, self.block_manager.capacity_tokens
        )
        self.eos_token_ids = frozenset(ckpt.tokenizer.eos_token_ids) | frozenset(ckpt.config.eos_token_ids)
        self._streams: dict[str, _Stream] = {}
        self._counters = _Counters()
        self._started = time.monotonic()

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.6)
        return 1 << 30

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

    def add_request(self, req: GenerationRequest) -> None:
        self.validate(req)
        if req.request_id in self._streams:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already running")
        seq = Sequence.from_request(req)
        self.scheduler.add(seq)
        self._streams[req.request_id] = _Stream(
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling.stop)
        )
        self._counters.prompt_tokens += len(req.prompt_token_ids)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or None if unknown."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        return self._final(seq, "", [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.request_ids()

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t0 = time.monotonic()
        try:
            sampled = self.runner.execute(batch)
        except Exception as exc:  # a failed forward fails its requests, never the engine
            log.exception("forward step failed; failing the %d requests in it", len(batch.seqs))
            outs = []
            for seq in batch.seqs:
                self.scheduler.finish(seq, FinishReason.ERROR)
                outs.append(self._final(seq, "", [], error=f"{type(exc).__name__}: {exc}"))
            return outs
        t1 = time.monotonic()
        padding = sum(1 for seq in batch.seqs if seq.padding)
        self._record_step(t0, t1, batch.total_tokens, len(batch.seqs) - padding, padding)

        outputs: list[RequestOutput] = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.status is SequenceStatus.FINISHED:  # padding released when its cohort ended above
                continue
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
            token = sampled.get(seq)
            if seq.padding:  # static-batching padding: computed, never reported
                if token is not None:
                    seq.token_ids.append(token)
                    if seq.num_tokens >= self.max_model_len:
                        self.scheduler.drop_padding(seq)
                continue
            if token is not None:
                out = self._append_token(seq, token, t1)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput | None:
        seq.token_ids.append(token)
        self._counters.generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        stream = self._streams[seq.request_id]
        params = seq.sampling
        reason: FinishReason | None = None
        text = ""
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = FinishReason.STOP
        else:
            text = stream.detok.add(token)
            if stream.detok.stopped:
                reason = FinishReason.STOP
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        new_ids = seq.output_token_ids[stream.emitted_tokens :]
        if reason is not None:
            self.scheduler.finish(seq, reason)
            return self._final(seq, text + stream.detok.flush(), new_ids)
        if not text and not new_ids:
            return None
        stream.emitted_tokens += len(new_ids)
        return RequestOutput(
            seq.request_id,
            text,
            new_ids,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.num_cached_prompt_tokens,
        )

    def _final(self, seq: Sequence, text: str, new_ids: list[int], error: str | None = None) -> RequestOutput:
        self._streams.pop(seq.request_id, None)
        self.runner.forget(seq.request_id)
        self._counters.finished += 1
        return RequestOutput(
            seq.request_id,
            text,
            new_ids,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.num_cached_prompt_tokens,
            error=error,
        )

    # ---- stats ---------------------------------------------------------------------------------

    def _record_step(self, t0: float, t1: float, tokens: int, seqs: int, padding: int) -> None:
        c = self._counters
        c.steps += 1
        c.step_tokens += tokens
        c.last_step_tokens = tokens
        c.last_step_seqs = seqs
        c.last_step_padding = padding
        c.busy.append((t0, t1))
        while c.busy and c.busy[0][1] < t1 - _BUSY_WINDOW_S:
            c.busy.popleft()

    def stats(self) -> EngineStats:
        c, s, bm = self._counters, self.scheduler, self.block_manager
        now = time.monotonic()
        window_start = max(self._started, now - _BUSY_WINDOW_S)
        busy = sum(min(b, now) - max(a, window_start) for a, b in c.busy if b > window_start)
        return EngineStats(
            running={p: s.num_running(p) for p in Priority},
            waiting={p: s.num_waiting(p) for p in Priority},
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            num_preemptions=s.num_preemptions,
            num_steps=c.steps,
            last_step_tokens=c.last_step_tokens,
            last_step_seqs=c.last_step_seqs,
            last_step_padding_seqs=c.last_step_padding,
            mean_tokens_per_step=c.step_tokens / c.steps if c.steps else 0.0,
            busy_fraction=busy / max(now - window_start, 1e-9),
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            finished_requests=c.finished,
            prompt_tokens=c.prompt_tokens,
            generated_tokens=c.generated_tokens,
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
        return merged


def merge_output(acc: dict[str, RequestOutput], out: RequestOutput) -> None:
    """Fold a delta into the running total for its request."""
    prev = acc.get(out.request_id)
    if prev is None:
        acc[out.request_id] = RequestOutput(**{**out.__dict__, "token_ids": list(out.token_ids)})
        return
    prev.text += out.text
    prev.token_ids.extend(out.token_ids)
    prev.finish_reason = out.finish_reason
    prev.prompt_tokens = out.prompt_tokens
    prev.completion_tokens = out.completion_tokens
    prev.cached_prompt_tokens = out.cached_prompt_tokens
    prev.error = out.error
