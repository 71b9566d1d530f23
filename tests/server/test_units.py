"""The server's pure parts, without a server: stream deltas against the real output
processor, the stop-string hold-back, request parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.sampling_params import SamplingParams
from tandem.engine.messages import EngineCoreOutput
from tandem.engine.output_processor import OutputProcessor
from tandem.server.deltas import ChoiceCursor, held_back
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, parse


class CharTokenizer:
    """One token per character: id = code point."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


def stream_and_final(text: str, stops: list[str], include_stop: bool = False):
    """Feed `text` token by token through the OutputProcessor; return the concatenated
    stream deltas, the final text, and how many deltas carried a finish reason."""
    proc = OutputProcessor(CharTokenizer())
    params = SamplingParams(
        max_tokens=len(text), stop=stops, include_stop_str_in_output=include_stop
    )
    proc.add_request("r", None, [ord("x")], params, 0.0)
    cursor = ChoiceCursor(0, 1, params.stop)
    streamed, finishes, final = "", 0, None
    for i, ch in enumerate(text):
        last = i == len(text) - 1
        outs, _ = proc.process([EngineCoreOutput("r", [ord(ch)], None, "length" if last else None)])
        for d in cursor.deltas(outs[0]):
            streamed += d.text
            finishes += d.finish_reason is not None
        if outs[0].finished:
            final = outs[0].outputs[0].text
            break
    return streamed, final, finishes


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    include_stop=st.booleans(),
)
def test_streamed_text_equals_the_final_text(text, stops, include_stop):
    streamed, final, finishes = stream_and_final(text, stops, include_stop)
    assert streamed == final
    assert finishes == 1


def test_stop_string_cut_and_held_back_prefix():
    assert stream_and_final("hello world", ["wor"]) == ("hello ", "hello ", 1)
    assert stream_and_final("abcabd", ["abd"]) == ("abc", "abc", 1)
    assert stream_and_final("abcab", ["abd"]) == ("abcab", "abcab", 1)


@pytest.mark.parametrize(
    "text, stops, expected",
    [("hello wo", ["world"], 2), ("hello", ["xyz"], 0), ("aab", ["abc", "b"], 2), ("", ["a"], 0)],
)
def test_held_back(text, stops, expected):
    assert held_back(text, stops) == expected


def test_parse_names_the_field():
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, json.dumps({"prompt": "x", "top_k": "5"}).encode())
    assert e.value.status == 400 and e.value.param == "top_k"
    with pytest.raises(APIError) as e:
        parse(ChatCompletionRequest, json.dumps({"messages": [{"role": 1}]}).encode())
    assert e.value.param == "messages" and "messages.0.role" in e.value.message
    req = parse(CompletionRequest, b'{"prompt": [[1, 2], [3]], "max_tokens": 4}')
    assert req.prompts() == [[1, 2], [3]] and req.max_tokens == 4


def test_request_defaults_follow_vllm():
    comp = parse(CompletionRequest, b'{"prompt": "x"}')
    params = comp.sampling_params(comp.max_tokens, comp.logprobs)
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.n == 1
    chat = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}]}')
    assert chat.max_output_tokens is None and chat.num_logprobs is None
    both = parse(
        ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],'
        b' "max_tokens": 5, "max_completion_tokens": 7, "logprobs": true}',
    )
    assert both.max_output_tokens == 7 and both.num_logprobs == 0
    assert both.messages[0].as_template_input() == {"role": "user", "content": "a"}
