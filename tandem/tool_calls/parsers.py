"""Tool-call parsers, by vLLM's names: each reads (content, calls) out of a model's text,
finished or still arriving.

    hermes       content <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}   (whole output)
    mistral      content [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    pythonic     [get_weather(city="Paris"), ...]                            (whole output)

and the two that `tool_choice` constrains with a grammar: `required` (a JSON array of
{"name", "parameters"}) and a named function (the whole output is its arguments).

Read from text still arriving, a parse only grows: content gains characters (a tail that
may begin a tool-call marker is held back), calls gain arguments, new calls come after.
A call's arguments are the model's own text of that JSON value, so the streamed fragments
concatenate to exactly the finished arguments. A finished text whose calls do not parse
(bad JSON, no name, arguments not an object) is all content, as vLLM answers.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from tandem.server.deltas import held_back  # a tail that may begin a marker, as a stop
from tandem.tool_calls.scan import Malformed, scan_call, skip_ws


@dataclass
class Call:
    name: str | None
    arguments: str  # JSON text, complete once `complete`
    complete: bool


@dataclass
class Parse:
    content: str
    calls: list[Call] = field(default_factory=list)


def _check_final(text: str, parse: Parse) -> Parse:
    """A finished text: every call complete, named, with an object of arguments, or it is
    all content."""
    for call in parse.calls:
        try:
            ok = call.complete and call.name and isinstance(json.loads(call.arguments), dict)
        except ValueError:
            ok = False
        if not ok:
            return Parse(text)
    return parse


def _json_calls(text: str, i: int, separators: str, closer: str | None) -> list[Call]:
    """Call objects from text[i], separated by any of `separators`, up to `closer` (or the
    end). Raises Malformed."""
    calls = []
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return calls
        c = text[i]
        if c in separators and calls:
            i += 1
            continue
        if closer is not None and c == closer:
            return calls
        if c != "{":
            raise Malformed(f"expected a call object at {i}")
        scan = scan_call(text, i)
        calls.append(Call(scan.name, scan.arguments(text), scan.end is not None))
        if scan.end is None:
            return calls
        i = scan.end


class ToolParser:
    name = ""

    def parse(self, text: str, final: bool) -> Parse:
        try:
            parse = self._parse(text, final)
        except Malformed:
            if final:
                return Parse(text)
            parse = self._parse_prefix(text)
        return _check_final(text, parse) if final else parse

    def _parse(self, text: str, final: bool) -> Parse:
        raise NotImplementedError

    def _parse_prefix(self, text: str) -> Parse:
        """What to report of a text that has gone wrong mid-stream: what it said before."""
        return Parse("")


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def _parse(self, text: str, final: bool) -> Parse:
        first = text.find(self.START)
        if first < 0:
            return Parse(text if final else text[: len(text) - held_back(text, [self.START])])
        parse, i = Parse(text[:first]), first
        while True:
            j = skip_ws(text, i + len(self.START))
            if j >= len(text):
                return parse
            if text[j] != "{":
                raise Malformed(f"expected a call object at {j}")
            scan = scan_call(text, j)
            parse.calls.append(Call(scan.name, scan.arguments(text), scan.end is not None))
            i = text.find(self.START, scan.end) if scan.end is not None else -1
            if i < 0:
                return parse

    def _parse_prefix(self, text: str) -> Parse:
        first = text.find(self.START)
        return Parse(text[:first] if first >= 0 else "")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _parse(self, text: str, final: bool) -> Parse:
        start = skip_ws(text, 0)
        rest = text[start:]
        if rest.startswith(self.TAG):
            start += len(self.TAG)
        elif not rest.startswith("{"):
            if not final and (not rest or self.TAG.startswith(rest)):
                return Parse("")  # not yet known whether calls follow
            return Parse(text)
        return Parse("", _json_calls(text, start, ";", None))


class MistralParser(ToolParser):
    name = "mistral"
    START = "[TOOL_CALLS]"

    def _parse(self, text: str, final: bool) -> Parse:
        first = text.find(self.START)
        if first < 0:
            return Parse(text if final else text[: len(text) - held_back(text, [self.START])])
        i = skip_ws(text, first + len(self.START))
        if i >= len(text):
            return Parse(text[:first])
        if text[i] != "[":
            raise Malformed("expected a JSON array after [TOOL_CALLS]")
        return Parse(text[:first], _json_calls(text, i + 1, ",", "]"))

    def _parse_prefix(self, text: str) -> Parse:
        first = text.find(self.START)
        return Parse(text[:first] if first >= 0 else "")


class PythonicParser(ToolParser):
    """[f(a=1), g(b="x")]: read when finished (a call's arguments are not JSON text, so
    they are converted, and streamed whole)."""

    name = "pythonic"

    def _parse(self, text: str, final: bool) -> Parse:
        if not text.lstrip().startswith("["):
            return Parse(text if final or text.strip() else "")
        if not final:
            return Parse("")
        try:
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise Malformed("not a list of calls")
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                    raise Malformed("not a call")
                if node.args:
                    raise Malformed("positional arguments")
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                calls.append(Call(node.func.id, json.dumps(args, ensure_ascii=False), True))
        except (SyntaxError, ValueError, TypeError) as e:
            raise Malformed(str(e)) from None
        return Parse("", calls)


class RequiredParser(ToolParser):
    """tool_choice="required": the grammar makes the output [{"name", "parameters"}, ...]."""

    name = "required"

    def _parse(self, text: str, final: bool) -> Parse:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parse("")
        if text[i] != "[":
            raise Malformed("expected a JSON array")
        return Parse("", _json_calls(text, i + 1, ",", "]"))


class NamedParser(ToolParser):
    """A named tool_choice: the grammar makes the whole output the function's arguments."""

    def __init__(self, function: str) -> None:
        self.function = function

    def _parse(self, text: str, final: bool) -> Parse:
        return Parse("", [Call(self.function, text, final)])


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def register_tool_parser(name: str):
    """Decorator for a plugin (--tool-parser-plugin FILE): @register_tool_parser("mine")
    on a ToolParser subclass makes --tool-call-parser mine use it."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        PARSERS[name] = cls
        return cls

    return register


def load_plugin(path: str) -> None:
    """Run a parser plugin file, which registers its parsers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tandem_tool_parser_plugin", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"tool_parser_plugin: cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise ValueError(f"tool_parser_plugin: no file {path!r}") from None
