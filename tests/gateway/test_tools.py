"""OpenAI tools over a text model (gateway/http/tools.py), without a server: what a request's tools
and tool_choice are refused for, the constraint each mode puts on the output, and how output text,
fed in pieces of any size, becomes content and tool calls again."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from gateway.http.endpoints import CHAT
from gateway.http.schema import ChatCompletionRequest
from gateway.http.tools import CALL_CLOSE, CALL_OPEN, ToolPlan, ToolShaper, plan_tools
from loadtest.tiny_model import random_checkpoint
from protocol.structured import ConstraintKind, grammar_tokenizer, grammar_violations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _plan(choice: Any = None, parallel: bool | None = None, tools: list[Any] | None = None) -> ToolPlan:
    plan, bad = plan_tools([WEATHER, TIME] if tools is None else tools, choice, parallel)
    assert bad == [] and plan is not None
    return plan


def _feed(shaper: ToolShaper, text: str, size: int) -> tuple[str, list[dict[str, Any]]]:
    """The text fed ``size`` characters at a time, then finished: all content and all call entries."""
    content, calls = "", []
    for i in range(0, len(text), size):
        c, t = shaper.feed(text[i : i + size])
        content, calls = content + c, calls + t
    c, t = shaper.finish()
    return content + c, calls + t


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ([{"type": "retrieval"}], None, "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            None,
            "tools[0].function.parameters",
        ),
        ([TIME, TIME], None, "tools"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
        ([WEATHER], "any", "tool_choice"),
        ([], "required", "tool_choice"),
    ],
)
def test_tools_and_tool_choice_refused_for_what_they_are(tools: list[Any], choice: Any, field: str) -> None:
    plan, bad = plan_tools(tools, choice, None)
    assert plan is None and [f for f, _ in bad] == [field]


def test_none_shows_no_tools_and_auto_is_the_default() -> None:
    assert plan_tools([WEATHER], "none", None) == (None, [])
    auto = _plan()
    assert auto.mode == "auto" and auto.constraint() is None and CALL_OPEN in auto.system_text()


def test_a_named_function_constrains_the_output_to_its_parameters() -> None:
    plan = _plan({"type": "function", "function": {"name": "get_weather"}})
    constraint = plan.constraint()
    assert constraint is not None and constraint.kind is ConstraintKind.JSON_SCHEMA
    assert json.loads(constraint.spec) == WEATHER["function"]["parameters"]  # type: ignore[index]
    content, calls = _feed(ToolShaper(plan), '{"city": "Oslo"}', 3)
    assert (
        content == "" and calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    )
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert all(c["index"] == 0 for c in calls) and all("id" not in c for c in calls[1:])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls_each_valid_for_its_tool(parallel: bool) -> None:
    plan = _plan("required", parallel)
    constraint = plan.constraint()
    assert constraint is not None
    schema = json.loads(constraint.spec)
    two = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    with pytest.raises(jsonschema.ValidationError):  # the arguments are held to the tool's parameters
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    content, calls = _feed(ToolShaper(plan), json.dumps(two[:1]), 5)
    assert content == "" and [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("size", [1, 2, 7, 1000])
def test_auto_streams_text_and_parses_calls_whatever_the_pieces(size: int) -> None:
    text = (
        "Let me check. "
        + CALL_OPEN
        + '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        + CALL_CLOSE
        + "\n"
        + CALL_OPEN
        + '{"name": "get_time", "arguments": {}}'
        + CALL_CLOSE
    )
    shaper = ToolShaper(_plan())
    content, calls = _feed(shaper, text, size)
    assert content == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert [c["index"] for c in calls] == [0, 1] and shaper.calls == 2


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_auto_text_without_a_call_is_all_content_even_a_partial_tag(size: int) -> None:
    text = "Plain answer, a < sign and <tool_ca"
    content, calls = _feed(ToolShaper(_plan()), text, size)
    assert content == text and calls == []


def test_auto_calls_that_do_not_parse_or_name_no_tool_are_returned_as_text() -> None:
    text = CALL_OPEN + '{"name": "launch_missiles", "arguments": {}}' + CALL_CLOSE
    content, calls = _feed(ToolShaper(_plan()), text, 4)
    assert calls == [] and content == text
    broken = CALL_OPEN + '{"name": "get_weather", "arguments": {' + CALL_CLOSE
    content, calls = _feed(ToolShaper(_plan()), broken, 4)
    assert calls == [] and content == broken


# ---- found in review: odd conversations, $defs, and the fields tools cannot go with --------------------


def _chat(**body: Any) -> tuple[Any, list[tuple[str, str]]]:
    request, bad = CHAT.to_request(ChatCompletionRequest(model="m", **body))
    return request, [f for f, _ in bad]


def test_odd_earlier_calls_and_results_are_written_not_crashed_on() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "calling"}],
            "tool_calls": [
                {"id": "a", "function": None},
                {"id": "b", "function": "x"},
                {"id": "c", "function": {"name": "f", "arguments": "[" * 100_000}},
                {"id": "d", "function": {"name": "g", "arguments": None}},
            ],
        },
        {"role": "tool", "tool_call_id": "d", "content": [{"type": "text", "text": "RESULT 42"}]},
    ]
    request, bad = _chat(messages=messages, tools=[WEATHER])
    assert bad == []
    turns = [m.content for m in request.messages]
    assert turns[2].startswith("calling\n") and '"name": "g", "arguments": {}' in turns[2]
    assert "RESULT 42" in turns[3]


def test_required_keeps_each_tools_definitions_resolvable() -> None:
    """Pydantic-made parameters put nested models under $defs; nested in the array of calls, their
    $refs must still resolve (each tool's definitions are lifted to the root under its own names)."""
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ship = {
        "type": "function",
        "function": {
            "name": "ship",
            "parameters": {
                "$defs": {"Address": address},
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"],
            },
        },
    }
    bill = json.loads(json.dumps(ship).replace('"ship"', '"bill"'))
    bill["function"]["parameters"]["$defs"]["Address"]["required"] = []  # the same name, another model
    constraint = _plan("required", tools=[ship, bill]).constraint()
    assert constraint is not None
    schema = json.loads(constraint.spec)
    assert grammar_violations(constraint, grammar_tokenizer(random_checkpoint().tokenizer)) == []
    jsonschema.validate([{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}], schema)
    jsonschema.validate([{"name": "bill", "arguments": {"to": {}}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # ship's Address, not bill's, for ship
        jsonschema.validate([{"name": "ship", "arguments": {"to": {}}}], schema)


def test_auto_without_parallel_calls_keeps_the_first_call() -> None:
    text = "".join(
        CALL_OPEN + json.dumps({"name": n, "arguments": None}) + CALL_CLOSE
        for n in ("get_time", "get_weather")
    )
    content, calls = _feed(ToolShaper(_plan(parallel=False)), text, 5)
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", "{}")
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [], "tools": [WEATHER]}, "messages"),
        ({"tool_choice": "required", "stop": ["}"]}, "stop"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stop": "\n"}, "stop"),
        ({"response_format": {"type": "json_object"}}, "tool_choice"),
        ({"guided_regex": "[a-z]+"}, "tool_choice"),
    ],
)
def test_what_tools_cannot_go_with_is_refused(body: dict[str, Any], field: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **body}
    _, bad = _chat(**body)
    assert bad == [field]
