"""Tool calling with the bundled model (SmolLM2-135M-Instruct) behind the real server:
`required` and named tool choices always parse into valid calls, and a round trip (call,
tool result, answer) works streamed and not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tandem.bench.workloads import tool_schemas
from tests.server.conftest import Server
from tests.server.test_structured_server import streamed

pytestmark = [pytest.mark.slow, pytest.mark.default_model]

NAMES = ("get_weather", "search_flights", "get_stock_quote", "convert_currency")
TOOLS = [t for t in tool_schemas() if t["function"]["name"] in NAMES]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Book me a flight from Paris to Rome on 2027-01-10."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = Server(None, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           "--kv-cache-memory", "0.2"],
                    tmp_path_factory.mktemp("logs"), "bundled-tools")  # fmt: skip
    try:
        server.wait_ready(timeout=600)
        with openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0) as c:
            yield c, c.models.list().data[0].id
    finally:
        server.stop()


def assert_valid(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "search_flights"}}]
)
def test_required_and_named_choices_always_parse_into_valid_calls(client, choice):
    c, model = client
    for seed in range(3):
        r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                      temperature=0.7, seed=seed, max_tokens=200,
                                      parallel_tool_calls=False)  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls"
        assert_valid(r.choices[0].message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_round_trip_call_result_answer(client, stream):
    c, model = client
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=200)  # fmt: skip
    if stream:
        _, [(name, arguments)], finish = streamed(c, model, **kw)
        call_id = "call_streamed"
    else:
        message = c.chat.completions.create(model=model, **kw).choices[0].message
        (call,) = message.tool_calls
        name, arguments, call_id, finish = (
            call.function.name,
            call.function.arguments,
            call.id,
            "tool_calls",
        )
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Booked: flight AF1234, 09:40."}]  # fmt: skip
    answer = c.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=60)  # fmt: skip
    choice = answer.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
