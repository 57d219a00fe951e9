"""OpenAI tool calling over a model that only writes text: what the request's ``tools`` and
``tool_choice`` turn into (a system turn that lists the tools, an output constraint), how a
conversation's earlier calls and results are written back as text, and how the output becomes
``message.tool_calls`` (or streamed ``delta.tool_calls``) again.

- ``tool_choice`` a named function: the output is constrained to that function's ``parameters``
  schema, so it is the call's arguments, streamed as they are generated.
- ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}`` calls (one
  at most without ``parallel_tool_calls``); the calls are sent when the array is complete.
- ``auto`` (the default with tools): the model is told how to write a call (``<tool_call>`` + JSON)
  and its output is read for them; text before a call streams as content.
- ``none``: the tools are not shown to the model; the answer is text.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol.limits import Violation
from protocol.structured import Constraint, ConstraintKind

MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its output."""

    mode: str  # "auto", "required" or "named"
    tools: tuple[Tool, ...]
    named: str | None = None  # the forced function's name (mode "named")
    parallel: bool = True

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.named)
            return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(tool.parameters), source="tools")
        if self.mode == "required":
            defs: dict[str, Any] = {}
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": _lift_defs(t.parameters, i, defs)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for i, t in enumerate(self.tools)
            ]
            schema = {
                "type": "array",
                "items": {"anyOf": calls},
                "minItems": 1,
                "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1,
            }
            if defs:
                schema["$defs"] = defs
            return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), source="tools")
        return None

    def system_text(self) -> str:
        listed = "\n".join(
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
            for t in self.tools
        )
        head = f"These functions are available to you, one JSON description per line:\n{listed}\n\n"
        if self.mode == "named":
            return head + f"Call the function {self.named} now: reply with its arguments as one JSON object."
        if self.mode == "required":
            return head + (
                'Call one or more of them now: reply with a JSON array of calls, each {"name": the '
                'function\'s name, "arguments": an object of its parameters}.'
            )
        return head + (
            f"To call one, write {CALL_OPEN}, then a JSON object with its name and arguments, then "
            f'{CALL_CLOSE}, for example {CALL_OPEN}{{"name": "...", "arguments": {{...}}}}{CALL_CLOSE}. '
            "Otherwise, answer in text."
        )


def _lift_defs(schema: dict[str, Any], tool: int, defs: dict[str, Any]) -> Any:
    """``schema`` with its own definitions (``$defs``, ``definitions``) moved into ``defs`` under
    names of this tool's, and its ``$ref``s rewritten to match: nested under the array of calls, a
    tool's parameters would otherwise point at definitions that are no longer at the root."""
    own = {
        f"{where}/{name}": f"t{tool}_{name}"
        for where in ("$defs", "definitions")
        for name in (schema.get(where) or {})
        if isinstance(schema.get(where), dict)
    }

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {
                k: rewrite(v)
                for k, v in node.items()
                if k not in ("$defs", "definitions") or node is not schema
            }
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/") and ref[2:] in own:
                out["$ref"] = f"#/$defs/{own[ref[2:]]}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for where in ("$defs", "definitions"):
        for name, sub in (schema.get(where) or {}).items() if isinstance(schema.get(where), dict) else ():
            defs[f"t{tool}_{name}"] = rewrite(sub)
    return rewrite(schema)


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None
) -> tuple[ToolPlan | None, list[Violation]]:
    """The plan for a request's ``tools`` and ``tool_choice``, or why they are refused."""
    bad: list[Violation] = []
    parsed: list[Tool] = []
    for i, t in enumerate(tools or ()):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            bad.append((f"tools[{i}]", 'must be {"type": "function", "function": {...}}'))
            continue
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            bad.append((f"tools[{i}].function.name", "must be 1-64 letters, digits, _ . or -"))
            continue
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            bad.append((f"tools[{i}].function.parameters", "must be a JSON schema object"))
            continue
        description = fn.get("description") or ""
        parsed.append(Tool(name, description if isinstance(description, str) else "", params))
        if len(bad) >= 4:
            break
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        bad.append(("tools", "function names must be distinct"))
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            bad.append(
                (
                    "tool_choice",
                    'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                )
            )
        elif name not in names:
            bad.append(("tool_choice", "names a function that is not in tools"))
        plan_mode, named = "named", name
    elif choice in ("none", "auto", "required"):
        plan_mode, named = choice, None
    else:
        bad.append(("tool_choice", 'must be "none", "auto", "required" or a named function'))
        plan_mode, named = "none", None
    if plan_mode in ("required", "named") and not parsed and not bad:
        bad.append(("tool_choice", "needs tools"))
    if bad or plan_mode == "none" or not parsed:
        return None, bad
    return ToolPlan(plan_mode, tuple(parsed), named, parallel is not False), bad


def tool_turns(message: Any, text: str) -> str | None:
    """The text of an earlier tool turn, as the model is told to write (assistant calls) or reads
    (results); None for an ordinary message. ``message``: a ChatMessageIn; ``text``: its content as
    text (parts joined)."""
    if message.role == "assistant" and message.tool_calls:
        calls = []
        for call in message.tool_calls:
            fn = call.get("function") if isinstance(call, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            args = fn.get("arguments")
            if args is None:
                args = {}
            with contextlib.suppress(ValueError, RecursionError):  # not JSON: kept as the text it is
                args = json.loads(args) if isinstance(args, str) else args
            name = fn.get("name") if isinstance(fn.get("name"), str) else ""
            with contextlib.suppress(ValueError, RecursionError):
                calls.append(CALL_OPEN + json.dumps({"name": name, "arguments": args}) + CALL_CLOSE)
        return (text + "\n" if text else "") + "\n".join(calls)
    if message.role == "tool":
        return f"<tool_response>\n{text}\n</tool_response>"
    return None


def _call(name: str, arguments: str, index: int) -> dict[str, Any]:
    return {
        "index": index,
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass
class ToolShaper:
    """One choice's output, read for tool calls as it streams. ``feed`` and ``finish`` return what to
    send now: content text and ``tool_calls`` entries (OpenAI's streamed shape: the first entry of a
    call has its id and name; later ones add to its arguments)."""

    plan: ToolPlan
    _held: str = ""
    _in_calls: bool = False
    _started: bool = False
    calls: int = 0  # tool calls sent so far
    _names: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        self._names = frozenset(t.name for t in self.plan.tools)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.plan.mode == "named":  # the text is the arguments, streamed as they come
            if not text and self._started:
                return "", []
            if not self._started:
                self._started, self.calls = True, 1
                return "", [_call(self.plan.named or "", text, 0)]
            return "", [{"index": 0, "function": {"arguments": text}}]
        if self.plan.mode == "required" or self._in_calls:
            self._held += text
            return "", []
        text = self._held + text
        at = text.find(CALL_OPEN)
        if at >= 0:
            self._in_calls, self._held = True, text[at:]
            return text[:at], []
        keep = _partial_tag(text)  # text that may be the start of a call tag waits
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        held, self._held = self._held, ""
        if self.plan.mode == "named":
            return ("", [_call(self.plan.named or "", "", 0)]) if not self._started else ("", [])
        found = self._parse(held)
        if not found:
            return held, []
        if not self.plan.parallel:
            found = found[:1]
        self.calls = len(found)
        return "", [_call(name, args, i) for i, (name, args) in enumerate(found)]

    def _parse(self, text: str) -> list[tuple[str, str]]:
        if self.plan.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return []
            return [c for item in items if (c := self._one(item))] if isinstance(items, list) else []
        calls = []
        for chunk in text.split(CALL_OPEN)[1:]:
            body = chunk.split(CALL_CLOSE, 1)[0].strip()
            try:
                item = json.loads(body)
            except ValueError:
                continue
            if c := self._one(item):
                calls.append(c)
        return calls

    def _one(self, item: Any) -> tuple[str, str] | None:
        if not isinstance(item, dict) or item.get("name") not in self._names:
            return None
        args = item.get("arguments", item.get("parameters"))
        if args is None:
            args = {}
        return item["name"], json.dumps(args) if not isinstance(args, str) else args


def _partial_tag(text: str) -> int:
    """How many of ``text``'s last characters could begin a call tag."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
