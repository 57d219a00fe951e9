"""Structured output and tool calls through the real gateway and the embedded SmolLM2, driven by the
official ``openai`` SDK (and gRPC for the same constraints): every constrained answer parses and
validates, forced tool calls come back as OpenAI shapes them, and a constraint that cannot be enforced
is a precise 400 / INVALID_ARGUMENT before anything is admitted."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from gateway.grpc.stubs import pb
from tests.gateway.conftest import SMOL, TINY, Gateway
from tests.gateway.test_gateway_e2e import collect

ASK = [{"role": "user", "content": "Describe a person you know, as data."}]
# As OpenAI asks of json_object: the conversation itself asks for JSON.
JSON_ASK = [{"role": "user", "content": 'Reply in JSON, as {"name": ..., "age": ...}: who wrote Hamlet?'}]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema of the shapes agents send: nested objects with required fields, arrays, enums,
    bounded integers and numbers, booleans and bounded strings."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
    if kind == "integer":
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([9, 100, 5000])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "north", "south", "small", "large"], k=3)}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": 3}
    names = rng.sample(
        ["name", "age", "city", "score", "tags", "active", "kind", "size", "note"], k=rng.randint(1, 4)
    )
    props = {n: random_schema(rng, depth + 1) for n in names}
    return {
        "type": "object",
        "properties": props,
        "required": rng.sample(names, k=rng.randint(1, len(names))),
        "additionalProperties": False,
    }


def _object_schema(rng: random.Random) -> dict[str, Any]:
    while (schema := random_schema(rng))["type" if "type" in schema else "enum"] != "object":
        pass
    return schema


async def test_generated_schemas_always_parse_and_validate(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    client = gateway.openai(key)
    rng = random.Random(24)
    schemas = [_object_schema(rng) for _ in range(8)]

    async def one(i: int, schema: dict[str, Any]) -> None:
        answer = await client.chat.completions.create(
            model=SMOL,
            messages=ASK,
            max_tokens=300,
            temperature=0 if i % 2 else 0.8,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)

    await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))


async def test_a_streamed_json_object_parses(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    stream = await gateway.openai(key).chat.completions.create(
        model=SMOL,
        messages=JSON_ASK,
        max_tokens=200,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and isinstance(json.loads(text), dict)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def _params(name: str) -> dict[str, Any]:
    return {WEATHER["function"]["name"]: WEATHER, TIME["function"]["name"]: TIME}[name]["function"][
        "parameters"
    ]


async def test_a_named_tool_call_parses_with_the_sdk(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    client = gateway.openai(key)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    answer = await client.chat.completions.create(
        model=SMOL,
        messages=WEATHER_Q,
        tools=[WEATHER, TIME],
        tool_choice=forced,
        max_tokens=100,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), _params("get_weather"))

    # Streamed: the call's id and name first, then its arguments as they are generated.
    stream = await client.chat.completions.create(
        model=SMOL,
        messages=WEATHER_Q,
        tools=[WEATHER, TIME],
        tool_choice=forced,
        max_tokens=100,
        temperature=0,
        stream=True,
    )
    names, args, finish, pieces = [], "", None, 0
    async for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or ():
            if d.function.name:
                names.append(d.function.name)
            args += d.function.arguments or ""
            pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls" and pieces > 2
    assert args == call.function.arguments  # greedy: the same call, streamed


async def test_required_tool_calls_name_a_tool_and_validate(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    for parallel in (True, False):
        answer = await gateway.openai(key).chat.completions.create(
            model=SMOL,
            messages=WEATHER_Q,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=150,
            temperature=0,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert 1 <= len(choice.message.tool_calls) <= (8 if parallel else 1)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), _params(call.function.name))


async def test_a_conversation_with_earlier_tool_results_is_served(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    messages: list[dict[str, Any]] = [
        *WEATHER_Q,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    answer = await gateway.openai(key).chat.completions.create(
        model=SMOL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=20, temperature=0
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


async def test_auto_lets_the_model_choose_and_either_answer_is_well_formed(gateway: Gateway) -> None:
    """With tool_choice auto the model decides. Whatever it wrote, streamed and whole agree: text as
    content, or calls of listed tools whose arguments parse (the shaper's own cases are in
    tests/gateway/test_tools.py)."""
    _, key = await gateway.tenant()
    client = gateway.openai(key)
    asks = [WEATHER_Q, [{"role": "user", "content": "Say hello to me."}]]
    for messages in asks:
        whole = await client.chat.completions.create(
            model=SMOL, messages=messages, tools=[WEATHER, TIME], max_tokens=60, temperature=0
        )
        choice = whole.choices[0]
        calls = choice.message.tool_calls or []
        if calls:
            assert choice.finish_reason == "tool_calls"
            for call in calls:
                assert call.function.name in ("get_weather", "get_time")
                json.loads(call.function.arguments)
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content
            assert "<tool_call>" not in choice.message.content or choice.finish_reason == "length"
        stream = await client.chat.completions.create(
            model=SMOL, messages=messages, tools=[WEATHER, TIME], max_tokens=60, temperature=0, stream=True
        )
        text, names, finish = "", [], None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            text += delta.content or ""
            names += [d.function.name for d in delta.tool_calls or () if d.function.name]
            finish = chunk.choices[0].finish_reason or finish
        assert finish == choice.finish_reason and names == [c.function.name for c in calls]
        if not calls:
            assert text == choice.message.content


async def test_vllm_constraints_regex_choice_and_grammar(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    client = gateway.openai(key)
    ask = [{"role": "user", "content": "Give me a date."}]
    regex = r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d"
    answer = await client.chat.completions.create(
        model=SMOL,
        messages=ask,
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, answer.choices[0].message.content)
    options = ["yes", "no", "it depends"]
    for field in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        picked = await client.completions.create(
            model=SMOL,
            prompt="Is the sky blue? Answer:",
            max_tokens=10,
            temperature=0.9,
            seed=3,
            extra_body=field,
        )
        assert picked.choices[0].text in options
    grammar = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    answer = await client.chat.completions.create(
        model=SMOL,
        messages=ask,
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", answer.choices[0].message.content)


async def test_n_choices_and_logprobs_under_a_constraint(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    answer = await gateway.openai(key).chat.completions.create(
        model=SMOL,
        messages=JSON_ASK,
        max_tokens=150,
        temperature=0.9,
        seed=5,
        n=3,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_object"},
    )
    assert len(answer.choices) == 3
    for choice in answer.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert sum(len(c.logprobs.content) for c in answer.choices) == answer.usage.completion_tokens


async def test_grpc_constraints_are_enforced(gateway: Gateway) -> None:
    _, key = await gateway.tenant()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    async with gateway.client(key) as client:
        _, text, _, last = await collect(
            client.generate_call(
                pb.GenerateRequest(
                    model=SMOL, prompt="JSON:", max_tokens=30, temperature=0, json_schema=json.dumps(schema)
                )
            )
        )
        assert last.finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text), schema)
        _, text, _, _ = await collect(
            client.generate_call(
                pb.GenerateRequest(
                    model=SMOL,
                    prompt="Colour:",
                    max_tokens=10,
                    temperature=0,
                    choice=pb.Choices(options=["red", "blue"]),
                )
            )
        )
        assert text in ("red", "blue")
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await collect(client.generate_call(pb.GenerateRequest(model=SMOL, prompt="x", regex="a(b")))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in (bad.value.details() or "")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format.json_schema.schema",
            "objectx",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "regex"),
        (
            {"structured_outputs": {"grammar": "start: nothing_defined"}},
            "structured_outputs.grammar",
            "unknown",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
        ({"guided_regex": "x" * 70_000}, "guided_regex", "longer than"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "weird"}},
                }
            },
            "response_format.json_schema.schema",
            "format",
        ),
    ],
)
async def test_a_constraint_that_cannot_be_enforced_is_a_precise_400(
    gateway: Gateway, extra: dict[str, Any], param: str, words: str
) -> None:
    _, key = await gateway.tenant()
    with pytest.raises(openai.BadRequestError) as info:
        await gateway.openai(key).chat.completions.create(
            model=TINY, messages=ASK, max_tokens=5, extra_body=extra
        )
    body = info.value.body
    assert body["param"] == param and words in body["message"], body
