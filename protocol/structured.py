"""Constraints on what a request may generate: a JSON schema, any JSON object, a regex, one of a list
of choices, or a grammar. The one definition both the gateway (which refuses a bad one before
admission) and the engine (which enforces it token by token) use.

A constraint becomes an llguidance grammar (ADR 0009: llguidance builds a grammar in under 10 ms
where xgrammar took 1.4 s for one long string bound, and its work per step is capped by fuel limits,
so a tenant's schema cannot stall the replica's other rows). Building or checking one needs the
model's tokenizer as llguidance sees it (:func:`grammar_tokenizer`, built once per tokenizer).
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.limits import LIMITS, Violation

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from protocol.tokenizer import Tokenizer


class ConstraintKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"  # spec: the pattern (Rust regex syntax, anchored at both ends)
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # spec: a Lark grammar (llguidance's dialect) or a GBNF one ("::=" rules)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. ``source`` names the request field it came from, so a
    refusal says which of the client's fields is wrong; it is not part of the constraint's identity."""

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    source: str = field(default="", compare=False)

    @property
    def field_name(self) -> str:
        return self.source or str(self.kind)

    def digest(self) -> str:
        """Identifies the grammar: equal constraints (whatever field carried them) share a digest."""
        h = hashlib.sha256(self.kind.value.encode() + b"\x00" + self.spec.encode("utf-8", "surrogatepass"))
        for choice in self.choices:
            h.update(b"\x00" + choice.encode("utf-8", "surrogatepass"))
        return h.hexdigest()


# JSON as models mostly saw it (", " and ": "), and no free whitespace: with flexible whitespace a
# model may emit spaces until max_tokens, which parses nowhere.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


# A bounded JSON number may take at most this many digits after the point. Without a cap a bound
# can trap a model: under "maximum": 1, after "1." only zeros are allowed, and a model that wanted
# another digit writes zeros until max_tokens (seen with SmolLM2 at temperature 0.8). Bounded
# numbers have no exponent in llguidance's grammar, so the cap costs only precision below 1e-10.
JSON_NUMBER_FRACTION_DIGITS = 10
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_VALUES = frozenset({"const", "enum", "default", "examples"})  # JSON data, not subschemas


def _cap_fraction_digits(node: Any) -> Any:
    """``node`` with every bounded number subschema (one without ``multipleOf``) given
    ``multipleOf: 1e-JSON_NUMBER_FRACTION_DIGITS``; the client's schema itself is left as it is."""
    if isinstance(node, list):
        return [_cap_fraction_digits(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _VALUES else _cap_fraction_digits(v) for k, v in node.items()}
    kind = node.get("type")
    is_number = kind == "number" or (isinstance(kind, list) and "number" in kind)
    if is_number and "multipleOf" not in node and any(b in node for b in _BOUNDS):
        out["multipleOf"] = float(f"1e-{JSON_NUMBER_FRACTION_DIGITS}")
    return out


def _limits() -> Any:
    from llguidance import LLParserLimits

    # Fuel caps the work of one mask (llguidance's figures: ~14k lexer fuel and ~20k Earley items
    # per ms), so the worst row costs a few ms of a step; a grammar that needs more fails its own
    # request. No schema text in error messages (they reach logs).
    return LLParserLimits(
        step_lexer_fuel=LIMITS.grammar_step_lexer_fuel,
        step_max_items=LIMITS.grammar_step_max_items,
        initial_lexer_fuel=LIMITS.grammar_initial_lexer_fuel,
        max_grammar_size=LIMITS.grammar_max_size,
        verbose_errors=False,
    )


def size_violations(c: Constraint) -> list[Violation]:
    """Bounds checked before any grammar work: the spec's size and the choices' count and sizes."""
    bad: list[Violation] = []
    limit = LIMITS.max_constraint_bytes
    if len(c.spec) > limit or len(c.spec.encode("utf-8", "surrogatepass")) > limit:
        bad.append((c.field_name, f"is longer than {limit} bytes"))
    elif not _is_utf8(c.spec) or not all(_is_utf8(s) for s in c.choices if isinstance(s, str)):
        bad.append((c.field_name, "is not valid Unicode text (it holds a lone surrogate)"))
    if c.kind is ConstraintKind.CHOICE:
        if not c.choices:
            bad.append((c.field_name, "needs at least one choice"))
        elif len(c.choices) > LIMITS.max_choice_options:
            bad.append((c.field_name, f"at most {LIMITS.max_choice_options} choices, got {len(c.choices)}"))
        elif any(not isinstance(s, str) or not s for s in c.choices):
            bad.append((c.field_name, "choices must be non-empty strings"))
        elif sum(len(s) for s in c.choices) > limit:
            bad.append((c.field_name, f"choices are longer than {limit} characters in all"))
    elif c.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR) and not c.spec:
        bad.append((c.field_name, "is empty"))
    return bad


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar for ``c``; raises ValueError (its message for the client) when the spec
    is not even well-formed (a schema that is not JSON)."""
    from llguidance import LLMatcher

    if c.kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = _cap_fraction_digits(json.loads(c.spec))
        except ValueError:
            raise ValueError("the schema is not valid JSON") from None
        except RecursionError:
            raise ValueError("the schema is nested too deeply") from None
        if schema is False:
            raise ValueError("the schema false admits no value")
        if schema is True:  # any JSON value; llguidance applies its options to object schemas only
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
    if c.kind is ConstraintKind.JSON_OBJECT:
        return str(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS))
    if c.kind is ConstraintKind.REGEX:
        return str(LLMatcher.grammar_from_regex(c.spec))
    if c.kind is ConstraintKind.CHOICE:
        # Lark string literals are JSON strings: json.dumps quotes any text exactly.
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.choices)))
    lark = c.spec
    if "::=" in lark:  # GBNF, as llama.cpp and vLLM's xgrammar backend take it
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(lark)
        except Exception as exc:  # the converter's own parse errors, of any type
            # Its own errors (GbnfToLarkError, or a bare Exception) say where and what; another
            # type is its bug, and its words would only confuse.
            said = (
                " ".join(str(exc).split())[:200]
                if type(exc).__name__ in ("GbnfToLarkError", "Exception")
                else ""
            )
            raise ValueError("the GBNF grammar does not parse" + (f": {said}" if said else "")) from None
    return str(LLMatcher.grammar_from_lark(lark))


_TOKENIZERS: dict[tuple[int, int], Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Tokenizer, n_vocab: int | None = None) -> Any:
    """The llguidance view of ``tokenizer`` (about 0.2 s to build; kept per tokenizer and vocabulary
    size). ``n_vocab``: the model's logits width, when it exceeds the tokenizer's vocabulary."""
    from llguidance import LLTokenizer

    key = (id(tokenizer.backend), n_vocab or tokenizer.vocab_size)
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(key)
        if found is None or found[0] is not tokenizer.backend:
            eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
            built = LLTokenizer(tokenizer.backend.to_str(), n_vocab=key[1], eos_token=eos)
            found = _TOKENIZERS[key] = (tokenizer.backend, built)
        return found[1]


def grammar_violations(c: Constraint, lltokenizer: Any) -> list[Violation]:
    """Why ``c`` cannot be enforced (empty when it can): too large, not well-formed, or refused by the
    grammar library (an unsupported keyword, a grammar over its size or fuel limits)."""
    bad = size_violations(c)
    if bad:
        return bad
    from llguidance import LLMatcher

    try:
        grammar = grammar_text(c)
    except ValueError as exc:
        return [(c.field_name, str(exc))]
    error = LLMatcher.validate_grammar(grammar, lltokenizer, limits=_limits())
    if error:
        return [(c.field_name, error_summary(error))]
    # Some grammars are well-formed yet admit no output at all (a schema that only refers to
    # itself): the first mask finds them, within the first step's fuel.
    matcher = LLMatcher(lltokenizer, grammar, limits=_limits(), log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        reason = error_summary(matcher.get_error())
        # A bare internal name (NoExtensionBias) says nothing to the client.
        return [(c.field_name, "admits no output" + (f": {reason}" if " " in reason else ""))]
    return []


def new_matcher(c: Constraint, lltokenizer: Any) -> Any:
    """A fresh llguidance matcher for ``c``; in an error state (``is_error()``) if it cannot be built."""
    from llguidance import LLMatcher

    return LLMatcher(lltokenizer, grammar_text(c), limits=_limits(), log_level=0)


def error_summary(message: str) -> str:
    """llguidance's message without the grammar excerpt it quotes below (that is the client's text),
    bounded."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return "the grammar is not supported"
    # The reason, where the library gives it on a line of its own (a regex's "error: ..."), joins
    # the first line; the excerpt lines between them are dropped.
    reason = next(
        (line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), ""
    )
    head = lines[0].rstrip(":")
    return (f"{head}: {reason}" if reason else head)[:300]
