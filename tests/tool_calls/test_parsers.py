"""Tool-call parsers: what each reads out of a finished text, and that streaming any split
of a text reassembles exactly the finished parse (content, names, arguments)."""

from __future__ import annotations

import json
import random

import pytest

from tandem.tool_calls.parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    PythonicParser,
    RequiredParser,
    load_plugin,
)
from tandem.tool_calls.streaming import ToolCallStream

WORDS = ["Paris", "a}b", 'quo"te', "back\\slash", "brace{", "東京", "🙂", "<tool_call>", "x y"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(WORDS) + str(rng.randrange(100))
    if kind == 1:
        return rng.choice([rng.randrange(-1000, 1000), rng.random() * 100, True, False, None])
    if kind == 2:
        return rng.randrange(10**6)
    if kind == 3:
        return rng.choice(WORDS)
    if kind == 4:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def random_calls(rng: random.Random) -> list[tuple[str, str]]:
    """(name, arguments as the model writes them: any spacing json.dumps can give)."""
    calls = []
    for _ in range(rng.randrange(1, 4)):
        args = {f"arg_{i}": random_value(rng) for i in range(rng.randrange(4))}
        sep = rng.choice([(", ", ": "), (",", ":"), (",  ", " : ")])
        text = json.dumps(args, separators=sep, ensure_ascii=rng.random() < 0.5)
        calls.append((rng.choice(["get_weather", "search", "f", "run_sql_2"]), text))
    return calls


def hermes_text(rng, calls) -> str:
    content = rng.choice(["", "Let me check. ", "<tool", "x < y; "])
    parts = []
    for name, args in calls:
        first = [f'"name": {json.dumps(name)}', f'"arguments": {args}']
        if rng.random() < 0.3:
            first.reverse()  # arguments before the name
        parts.append(f"<tool_call>\n{{{', '.join(first)}}}\n</tool_call>")
    return content + rng.choice(["\n", ""]).join(parts)


def llama3_text(rng, calls) -> str:
    tag = rng.choice(["", "<|python_tag|>"])
    sep = rng.choice(["; ", ";"])
    return tag + sep.join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)


def replay(parser, text: str, cuts: list[int]):
    """Stream text in pieces ending at each cut, then finish: (content, [(name, args)])."""
    stream, content, calls = ToolCallStream(parser), "", {}
    for k, end in enumerate([*cuts, len(text)]):
        c, deltas = stream.feed(text[:end], final=k == len(cuts))
        content += c
        for d in deltas:
            i = d["index"]
            if "id" in d:
                assert i == len(calls) and d["id"].startswith("call_")
                calls[i] = [d["function"]["name"], ""]
            else:
                calls[i][1] += d["function"]["arguments"]
    return content, [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("make, parser", [(hermes_text, HermesParser()),
                                          (llama3_text, Llama3JsonParser())])  # fmt: skip
def test_streaming_split_at_every_character_reassembles_the_finished_parse(make, parser):
    rng = random.Random(0)
    for _ in range(250):  # 250 outputs of each format (500 in all), every split point of each
        calls = random_calls(rng)
        text = make(rng, calls)
        final = parser.parse(text, final=True)
        assert [(c.name, c.arguments) for c in final.calls] == calls, text
        for cut in range(len(text) + 1):
            assert replay(parser, text, [cut]) == (final.content, calls), (text, cut)
        pieces = sorted(rng.sample(range(len(text)), min(len(text), 12)))
        assert replay(parser, text, pieces) == (final.content, calls)


def test_hermes_reads_content_then_calls():
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>'
    parse = HermesParser().parse(text, final=True)
    assert parse.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parse.calls] == [("f", {"a": [1, "}"]})]


def test_a_text_that_may_begin_a_marker_is_held_back_until_it_does_not():
    parser = HermesParser()
    assert parser.parse("a <tool_c", final=False).content == "a "
    assert parser.parse("a <tool_x", final=False).content == "a <tool_x"
    assert parser.parse("a <tool_c", final=True).content == "a <tool_c"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',  # bad JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off
])  # fmt: skip
def test_a_finished_text_whose_calls_do_not_parse_is_all_content(text):
    parse = HermesParser().parse(text, final=True)
    assert parse.content == text and parse.calls == []


def test_llama3_json_needs_the_output_to_begin_with_a_call():
    p = Llama3JsonParser()
    assert p.parse('The answer {"name": "f"}', final=True).calls == []
    assert p.parse("  <|python", final=False).content == ""  # may still become the tag
    calls = p.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g"}', True)
    assert [(c.name, c.arguments) for c in calls.calls] == [("f", '{"x": 1}'), ("g", "{}")]


def test_mistral_pythonic_required_and_named_formats():
    m = MistralParser().parse('Hi[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]', True)
    assert m.content == "Hi" and [(c.name, c.arguments) for c in m.calls] == [("f", '{"x": 1}')]
    p = PythonicParser().parse('[get_weather(city="Paris", days=2), noop()]', final=True)
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("noop", {}),
    ]
    assert PythonicParser().parse("[get_weather(city=", final=False).calls == []
    assert PythonicParser().parse("[1 + ", final=True).content == "[1 + "
    r = RequiredParser().parse(
        '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"a": 1}}]', True
    )  # noqa: E501
    assert [(c.name, c.arguments) for c in r.calls] == [("f", "{}"), ("g", '{"a": 1}')]
    assert NamedParser("f").parse('{"a": 1}', final=True).calls[0].arguments == '{"a": 1}'


def test_a_plugin_file_registers_a_parser(tmp_path):
    plugin = tmp_path / "mine.py"
    plugin.write_text(
        "from tandem.tool_calls.parsers import Parse, Call, ToolParser, register_tool_parser\n"
        "@register_tool_parser('upper')\n"
        "class Upper(ToolParser):\n"
        "    def _parse(self, text, final):\n"
        "        return Parse('', [Call(text.upper(), '{}', final)])\n"
    )
    load_plugin(str(plugin))
    try:
        assert PARSERS["upper"]().parse("f", final=True).calls[0].name == "F"
    finally:
        PARSERS.pop("upper")
    with pytest.raises(ValueError, match="tool_parser_plugin: no file"):
        load_plugin(str(tmp_path / "missing.py"))
