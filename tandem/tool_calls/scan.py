"""A JSON scanner that reads as far as the text goes: where a value ends, or that the text
ends inside it. The parsers read tool calls out of text that is still arriving with it, so
that what they report of a call only ever grows (its arguments are a raw slice of the
model's text, and a prefix of the slice the finished text gives)."""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


class Malformed(ValueError):
    """The text cannot be what the parser expects, however it goes on."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Just past the JSON string that starts at text[i] (a quote); None: it goes on."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Just past the JSON value that starts at text[i]; None: the text ends inside it (a
    number or literal at the very end may go on too)."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


@dataclass
class CallScan:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None  # just past the call's closing brace; None: not there yet

    def arguments(self, text: str) -> str:
        if self.args_start is None:
            return "{}" if self.end is not None else ""  # {"name": "f"}: no arguments
        return text[self.args_start : self.args_end if self.args_end is not None else len(text)]


def scan_call(text: str, i: int) -> CallScan:
    """The call object {"name": ..., "arguments" | "parameters": ...} at text[i] ("{")."""
    call, j, n = CallScan(), i + 1, len(text)
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return call
        c = text[j]
        if c == "}":
            call.end = j + 1
            return call
        if c == ",":
            j += 1
            continue
        if c != '"':
            raise Malformed(f"expected a key at {j}")
        key_end = string_end(text, j)
        if key_end is None:
            return call
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return call
        if text[j] != ":":
            raise Malformed(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if key in ARGUMENT_KEYS:
            call.args_start = j
        if j >= n:
            return call
        end = value_end(text, j)
        if key in ARGUMENT_KEYS:
            call.args_end = end
        elif key in NAME_KEYS and end is not None:
            name = json.loads(text[j:end])
            if not isinstance(name, str):
                raise Malformed("the name is not a string")
            call.name = name
        if end is None:
            return call
        j = end
