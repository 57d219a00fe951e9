"""What one request may ask of an engine: the single definition both the gateway and the engine check.

The gateway reports every violation at once (one INVALID_ARGUMENT naming each field); the engine
refuses on the first. Both call :func:`sampling_violations`, so a rule can never differ between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int = 1_000_000  # UTF-8 bytes of a prompt (all messages together), before tokenizing
    max_messages: int = 512
    max_tokens: int = 1_000_000
    max_temperature: float = 2.0
    greedy_below_temperature: float = 1e-5  # as vLLM: a smaller temperature samples greedily
    max_top_k: int = 1_000_000
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_logprobs: int = 20  # alternatives per token (OpenAI's top_logprobs bound)
    max_choices: int = 8  # completions of one prompt in one request (n)
    seed_bound: int = 2**63  # seeds are in [0, seed_bound)
    # Constrained output (protocol/structured.py). Fuel and size are llguidance's units; a step's
    # mask for one row costs at most a few ms with these (its figures: ~14k lexer fuel and ~20k
    # Earley items per ms), building a grammar at most ~20 ms.
    max_constraint_bytes: int = 64 * 1024  # a schema, regex or grammar's text; all choices together
    max_choice_options: int = 256
    grammar_step_lexer_fuel: int = 50_000
    grammar_step_max_items: int = 20_000
    grammar_initial_lexer_fuel: int = 1_000_000
    grammar_max_size: int = 200_000


LIMITS = RequestLimits()

Violation = tuple[str, str]  # (field, what is wrong with it)


def sampling_violations(
    *,
    max_tokens: object,
    temperature: float,
    top_p: float,
    top_k: object,
    seed: int | None,
    stop: tuple[str, ...],
    logprobs: int | None = None,
    limits: RequestLimits = LIMITS,
) -> list[Violation]:
    """Every sampling field outside its range, named, in field order."""
    bad: list[Violation] = []
    if not isinstance(max_tokens, int) or not (1 <= max_tokens <= limits.max_tokens):
        bad.append(("max_tokens", f"must be an integer from 1 to {limits.max_tokens}, got {max_tokens!r}"))
    if not (math.isfinite(temperature) and 0.0 <= temperature <= limits.max_temperature):
        bad.append(("temperature", f"must be in [0, {limits.max_temperature:g}], got {temperature!r}"))
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        bad.append(("top_p", f"must be in (0, 1], got {top_p!r}"))
    if not isinstance(top_k, int) or not (0 <= top_k <= limits.max_top_k):
        bad.append(("top_k", f"must be an integer from 0 (off) to {limits.max_top_k}, got {top_k!r}"))
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < limits.seed_bound):
        bad.append(("seed", f"must be in [0, 2**{limits.seed_bound.bit_length() - 1}), got {seed!r}"))
    if len(stop) > limits.max_stop_strings:  # its length first: a long list is not walked
        bad.append(("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}"))
    else:
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not (1 <= len(s) <= limits.max_stop_chars):
                bad.append((f"stop[{i}]", f"must be 1 to {limits.max_stop_chars} characters"))
    if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= limits.max_logprobs):
        bad.append(("logprobs", f"must be from 0 to {limits.max_logprobs} alternatives, got {logprobs!r}"))
    return bad
