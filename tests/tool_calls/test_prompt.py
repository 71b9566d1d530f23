"""What tools and tool_choice make of a chat request: the grammar of `required` and of a
named function, and the conversation a chat template sees, with or without tool support."""

import jsonschema
import pytest

from tandem.engine.tokenizer import apply_chat_template
from tandem.tool_calls.prompt import (
    conversation,
    required_schema,
    template_knows_tools,
    tool_choice_grammar,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "$defs": {"City": {"enum": ["Paris", "Rome"]}},
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_path))


def test_required_accepts_exactly_arrays_of_known_calls_with_valid_arguments():
    schema = required_schema([WEATHER, NOOP], parallel=True)
    ok = [
        {"name": "get_weather", "parameters": {"city": "Rome"}},
        {"name": "noop", "parameters": {}},
    ]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Oslo"}}],
                [{"name": "other", "parameters": {}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls=false: one call
        jsonschema.validate(ok, required_schema([WEATHER, NOOP], parallel=False))


def test_a_named_function_constrains_the_output_to_its_arguments():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    so, parser = tool_choice_grammar([NOOP, WEATHER], choice, parallel=True)
    assert so.json == WEATHER["function"]["parameters"] and so.source == "tool_choice"
    assert parser.parse('{"city": "Paris"}', final=True).calls[0].name == "get_weather"
    assert tool_choice_grammar([WEATHER], "auto", True) == (None, None)


def test_a_template_without_tools_gets_them_described_and_calls_written_out(tokenizer):
    assert not template_knows_tools(tokenizer.chat_template)
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    conv = conversation(messages, [WEATHER], False, "hermes")
    assert conv[0]["role"] == "system" and '"name": "get_weather"' in conv[0]["content"]
    assert "<tool_call>" in conv[0]["content"]
    assert conv[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    text = tokenizer.decode(apply_chat_template(tokenizer, conv))
    assert "<tools>" in text and "sunny" in text


def test_a_template_that_knows_tools_gets_them_and_calls_with_object_arguments(tokenizer):
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}({{ c.function.arguments.city }}){% endfor %}"
        "{% endfor %}"
    )
    assert template_knows_tools(template)
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]  # fmt: skip
    conv = conversation(messages, [WEATHER], True, "hermes")
    own, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        ids = apply_chat_template(tokenizer, conv, False, [WEATHER])
    finally:
        tokenizer.chat_template = own
    assert tokenizer.decode(ids) == "[get_weather]assistant:(Rome)"
