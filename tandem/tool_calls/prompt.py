"""What `tools` and `tool_choice` ask of a chat request: the grammar that `required` and a
named function impose, the parser that reads the calls back, and the conversation the
chat template sees.

A template that knows tools (it uses the `tools` variable) gets them as transformers
passes them, and assistant tool calls with their arguments as objects, as vLLM does. A
template that does not (SmolLM2's, for one) would drop them silently, so the tools are
described in a system message in the parser's own format, earlier calls are written into
the assistant's content the way the model is asked to write them, and tool results are
messages of role "tool".
"""

from __future__ import annotations

import json

from tandem.structured.params import StructuredOutputsParams
from tandem.tool_calls.parsers import NamedParser, RequiredParser, ToolParser

# How each parser asks the model to write a call (for templates that do not know tools).
CALL_FORMATS = {
    "hermes": "For each function call, return a JSON object with the function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "llama3_json": "To call a function, respond only with a JSON object of the form "
    '{"name": <function-name>, "parameters": <args-json-object>}.',
    "mistral": "To call functions, respond with [TOOL_CALLS] followed by a JSON list of "
    '{"name": <function-name>, "arguments": <args-json-object>}.',
    "pythonic": "To call functions, respond only with a Python list of calls with keyword "
    "arguments: [func_name(param=value, ...)].",
}


def tool_functions(tools: list[dict]) -> list[dict]:
    return [t["function"] for t in tools]


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """tool_choice="required": a JSON array of one or more {"name", "parameters"}, each a
    tool's name with arguments that match its schema. Each tool's $defs move to the top,
    where its "#/$defs/..." references point."""
    defs, choices = {}, []
    for f in tool_functions(tools):
        params = dict(f.get("parameters") or {"type": "object"})
        defs.update(params.pop("$defs", {}))
        choices.append({
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema = {"type": "array", "items": {"anyOf": choices}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_choice_grammar(
    tools: list[dict], tool_choice, parallel: bool
) -> tuple[StructuredOutputsParams | None, ToolParser | None]:
    """(grammar, parser) that `required` or a named function imposes; (None, None) else."""
    if tool_choice == "required":
        so = StructuredOutputsParams(json=required_schema(tools, parallel), source="tool_choice")
        return so, RequiredParser()
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        f = next(f for f in tool_functions(tools) if f["name"] == name)
        schema = f.get("parameters") or {"type": "object"}
        return StructuredOutputsParams(json=schema, source="tool_choice"), NamedParser(name)
    return None, None


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def conversation(
    messages: list[dict], tools: list[dict] | None, knows_tools: bool, parser_name: str | None
) -> list[dict]:
    """The messages as the chat template should see them."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls and knows_tools:
            m["tool_calls"] = [_with_object_arguments(c) for c in calls]
        elif calls:
            written = "\n".join(_write_call(c, parser_name) for c in calls)
            m["content"] = (m.get("content") or "") + written
            del m["tool_calls"]
        out.append(m)
    if tools and not knows_tools:
        text = _describe_tools(tools, parser_name)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _with_object_arguments(call: dict) -> dict:
    f = call.get("function") or {}
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": {**f, "arguments": args}}


def _write_call(call: dict, parser_name: str | None) -> str:
    f = call.get("function") or {}
    args = (
        f.get("arguments")
        if isinstance(f.get("arguments"), str)
        else json.dumps(f.get("arguments") or {})
    )
    name = json.dumps(f.get("name", ""))
    if parser_name == "llama3_json":
        return f'{{"name": {name}, "parameters": {args}}}'
    if parser_name == "mistral":
        return f'[TOOL_CALLS][{{"name": {name}, "arguments": {args}}}]'
    return f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call>'


def _describe_tools(tools: list[dict], parser_name: str | None) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    how = CALL_FORMATS.get(parser_name or "hermes", CALL_FORMATS["hermes"])
    return (
        "You may call one or more functions to assist with the user query. You are provided "
        f"with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
        f"</tools>\n\n{how}"
    )
