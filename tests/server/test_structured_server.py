"""Structured output and tool calling through the real server and the official openai
client: parsed pydantic models, every constrained output valid, tool calls with ids that
stream as OpenAI's deltas, errors as 400s naming the field (streamed ones too)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

CHAT = [{"role": "user", "content": "What is the weather like?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, CLOCK]


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=9)
    tags: list[Literal["sun", "rain"]] = Field(min_length=1, max_length=3)


@pytest.fixture
def tools_client(tools_server):
    with openai.OpenAI(api_key="x", base_url=f"{tools_server.url}/v1", max_retries=0) as c:
        yield c


def _assert_valid_calls(calls, tools=TOOLS):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def streamed(client, model_name, **kw):
    """(content, [(name, arguments)], finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model_name, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                calls[d.index][1] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


def test_parse_with_a_pydantic_model_returns_the_model(client, model_name):
    for temperature in (0.0, 1.0):
        r = client.chat.completions.parse(
            model=model_name, messages=CHAT, response_format=Forecast, max_tokens=80,
            temperature=temperature, seed=3,
        )  # fmt: skip
        assert isinstance(r.choices[0].message.parsed, Forecast)
        assert r.choices[0].finish_reason == "stop"


def test_streamed_json_schema_output_equals_the_non_streamed_one(client, model_name):
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "f", "schema": Forecast.model_json_schema()},
    }
    kw = dict(messages=CHAT, response_format=rf, max_tokens=80, temperature=0)
    whole = client.chat.completions.create(model=model_name, **kw).choices[0].message.content
    content, calls, finish = streamed(client, model_name, **kw)
    assert content == whole and not calls and finish == "stop"
    Forecast.model_validate_json(content)


def test_completions_take_vllms_fields(client, model_name):
    def text(**extra):
        r = client.completions.create(model=model_name, prompt="The quick", max_tokens=30,
                                      temperature=1.0, seed=1, extra_body=extra)  # fmt: skip
        return r.choices[0].text

    assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", text(guided_regex=r"[a-f]{3}-[0-9]{2}"))
    assert text(guided_choice=["left", "right"]) in ("left", "right")
    assert text(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")
    assert re.fullmatch(r"ab+", text(structured_outputs={"grammar": 'root ::= "a" "b"+'}))
    assert isinstance(json.loads(text(guided_json={"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
        "additionalProperties": False})), dict)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_fails_to_compile_is_a_400_even_when_streamed(http, stream):
    for body, param, fragment in [
        ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),  # the server's check
        ({"guided_regex": "a(?=b)"}, "guided_regex", "does not compile"),  # the engine's
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
          {"type": "object", "not": {"required": ["a"]}}}}}, "response_format", '["not"]'),
    ]:  # fmt: skip
        r = http.post("/v1/chat/completions",
                      json={"messages": CHAT, "max_tokens": 5, "stream": stream, **body})  # fmt: skip
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(param) and fragment in error["message"]
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200  # the engine went on


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_tool_choice_always_yield_parseable_calls(client, model_name,
                                                                     tool_choice):  # fmt: skip
    for seed in range(4):
        r = client.chat.completions.create(
            model=model_name, messages=CHAT, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=120, temperature=1.0, seed=seed,
            parallel_tool_calls=False,  # one call: the random model would list calls forever
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _assert_valid_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(client, model_name):
    kw = dict(messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    whole = client.chat.completions.create(model=model_name, **kw).choices[0]
    content, calls, finish = streamed(client, model_name, **kw)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == "" and finish == "tool_calls"


def test_a_tool_round_trip_call_result_answer(client, model_name):
    first = client.chat.completions.create(
        model=model_name, messages=CHAT, tools=[WEATHER], tool_choice="required", max_tokens=80,
        temperature=0, parallel_tool_calls=False,
    ).choices[0].message  # fmt: skip
    (call,) = first.tool_calls
    messages = [*CHAT, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
    answer = client.chat.completions.create(
        model=model_name, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0,
    ).choices[0]  # fmt: skip
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_auto_tool_choice_reads_hermes_calls_out_of_the_text(tools_client):
    """The tiny model will not write a call by itself: a regex makes it write one."""
    call = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)", "days": [1-5]\\}\\}\\n</tool_call>'  # noqa: E501
    kw = dict(messages=CHAT, tools=[WEATHER], max_tokens=200, temperature=1.0, seed=5,
              extra_body={"structured_outputs": {"regex": "Checking\\. " + call}})  # fmt: skip
    model = tools_client.models.list().data[0].id
    whole = tools_client.chat.completions.create(model=model, **kw).choices[0]
    assert whole.message.content == "Checking. " and whole.finish_reason == "tool_calls"
    _assert_valid_calls(whole.message.tool_calls)
    content, calls, finish = streamed(tools_client, model, **kw)
    assert content == "Checking. " and finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    plain = tools_client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS,
                                                 max_tokens=5, temperature=0)  # fmt: skip
    assert plain.choices[0].message.tool_calls is None  # no call in the text: content only


def test_json_schema_under_speculative_decoding(spec_server):
    with openai.OpenAI(api_key="x", base_url=f"{spec_server.url}/v1", max_retries=0) as c:
        model = c.models.list().data[0].id
        for seed in range(3):
            r = c.chat.completions.parse(model=model, messages=CHAT, response_format=Forecast,
                                         max_tokens=80, temperature=1.0, seed=seed)  # fmt: skip
            assert isinstance(r.choices[0].message.parsed, Forecast)
