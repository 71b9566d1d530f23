"""ToolCallStream: OpenAI's streamed tool calls from a choice's growing text.

Each feed re-reads the text so far and sends what is new: content characters, a call's
id and name once (with empty arguments), then its argument fragments. Concatenated, the
fragments are exactly the arguments of the finished text's parse, for they are slices of
the same text. A call is announced only once its name is known, and the calls after it
wait for it, so indices arrive in order.
"""

from __future__ import annotations

import uuid

from tandem.tool_calls.parsers import Call, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: Call, id_: str | None = None) -> dict:
    return {
        "id": id_ or call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.args_sent: list[int] = []  # per announced call: argument characters sent

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(new content, tool-call deltas) for the text so far."""
        parse = self.parser.parse(text, final)
        content = parse.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parse.content))
        deltas = []
        for i, call in enumerate(parse.calls):
            if call.name is None:
                break
            if i == len(self.args_sent):
                self.args_sent.append(0)
                deltas.append({"index": i, "id": call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})  # fmt: skip
            fragment = call.arguments[self.args_sent[i] :]
            if fragment:
                deltas.append({"index": i, "function": {"arguments": fragment}})
                self.args_sent[i] = len(call.arguments)
        return content, deltas

    @property
    def num_calls(self) -> int:
        return len(self.args_sent)
