"""The per-choice cursor that turns cumulative outputs into stream deltas.

Streamed text must equal the non-streamed text exactly. The output processor cuts the text
at a stop string only once the whole stop string has appeared, so while a choice's text
ends with what could be the start of a stop string, that tail is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.outputs import CompletionOutput, RequestOutput


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = min(len(text), max((len(s) for s in stops), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


@dataclass
class Delta:
    index: int  # the choice's index in the response
    text: str
    output: CompletionOutput
    token_start: int  # the tokens this delta covers, for logprobs: [start, end)
    token_end: int
    first: bool  # the choice's first delta
    finish_reason: str | None


class ChoiceCursor:
    """What has been sent of each of a prompt's n choices."""

    def __init__(self, base_index: int, n: int, stops: Sequence[str]) -> None:
        self.base_index = base_index
        self.stops = list(stops)
        self.sent_chars = [0] * n
        self.sent_tokens = [0] * n
        self.finished = [False] * n

    def deltas(self, output: RequestOutput) -> list[Delta]:
        out = []
        for c in output.outputs:
            i = c.index
            if self.finished[i]:
                continue
            done = c.finish_reason is not None
            end = (
                len(c.text)
                if done or not self.stops
                else len(c.text) - held_back(c.text, self.stops)
            )
            start = self.sent_chars[i]
            text = c.text[start : max(end, start)]
            if not text and not done:
                continue  # tokens whose text is incomplete or held back wait for the next delta
            tok_start, tok_end = self.sent_tokens[i], len(c.token_ids)
            out.append(
                Delta(
                    self.base_index + i,
                    text,
                    c,
                    tok_start,
                    tok_end,
                    start == 0 and tok_start == 0,
                    c.finish_reason,
                )
            )
            self.sent_chars[i] += len(text)
            self.sent_tokens[i] = tok_end
            self.finished[i] = done
        return out
