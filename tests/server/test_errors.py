"""Every error: its status and its OpenAI error body, naming the field where there is one."""

from __future__ import annotations

import openai
import pytest

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "hi"}]


def assert_error(r, status: int, param: str | None, *fragments: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for fragment in fragments:
        assert fragment in err["message"], err["message"]
    return err


@pytest.mark.parametrize(
    "body, param, fragments",
    [
        ({"max_tokens": "a"}, "max_tokens", ["max_tokens", "integer"]),
        ({"temperature": "hot"}, "temperature", ["temperature", "number"]),
        ({"n": 1.5}, "n", ["n:", "integer"]),
        ({"stream": "yes"}, "stream", ["stream", "bool"]),
        ({"stop": 5}, "stop", ["stop"]),
        ({"temperature": -1}, "temperature", ["temperature must be >= 0"]),
        ({"top_p": 1.5}, "top_p", ["top_p must be in (0, 1]"]),
        ({"top_k": -5}, "top_k", ["top_k"]),
        ({"min_p": 2}, "min_p", ["min_p must be in [0, 1]"]),
        ({"presence_penalty": 3}, "presence_penalty", ["in [-2, 2]"]),
        ({"frequency_penalty": -3}, "frequency_penalty", ["in [-2, 2]"]),
        ({"repetition_penalty": 0}, "repetition_penalty", ["> 0"]),
        ({"max_tokens": 0}, "max_tokens", ["max_tokens must be an integer >= 1"]),
        ({"n": 0}, "n", ["n must be an integer in [1, 256]"]),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", ["<= max_tokens"]),
        ({"logprobs": 21}, "logprobs", ["logprobs", "[0, 20]"]),
        ({"logprobs": -1}, "logprobs", [">= 0"]),
        ({"stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
        ({"stream": False, "stream_options": {}}, "stream_options", ["stream"]),
        ({"prompt": []}, "prompt", ["prompt"]),
        ({"prompt": [1, "a"]}, "prompt", ["prompt"]),
        ({"prompt": [5, 100000]}, "prompt", ["100000", "[0, 400)"]),
        ({"prompt": [[1, 2], [-1]]}, "prompt", ["-1"]),
        ({"prompt": None}, "prompt", ["prompt"]),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ["stop_token_ids"]),
    ],
)
def test_invalid_completion_fields_are_400(http, body, param, fragments):
    r = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    err = assert_error(r, 400, param, *fragments)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param, fragments",
    [
        ({"messages": []}, "messages", ["messages"]),
        ({"messages": [{"content": "no role"}]}, "messages", ["role"]),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", ["[0, 20]"]),
        ({"top_logprobs": 2}, "top_logprobs", ["logprobs"]),
        ({"logprobs": 3}, "logprobs", ["bool"]),
        ({"max_completion_tokens": 0}, "max_tokens", ["max_tokens"]),
        ({"stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
    ],
)
def test_invalid_chat_fields_are_400(http, body, param, fragments):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert_error(r, 400, param, *fragments)


def test_non_finite_numbers_are_400(http):
    body = b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}'
    r = http.post("/v1/chat/completions", content=body)
    assert_error(r, 400, "temperature", "temperature", "finite")


@pytest.mark.parametrize("raw", [b"{", b"not json", b"[1, 2]", b""])
def test_malformed_json_is_400(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, "body", "body")


def test_prompt_too_long_uses_vllm_wording(http, client, model_name):
    long_ids = [5] * 1030
    r = http.post("/v1/completions", json={"prompt": long_ids})
    assert_error(
        r,
        400,
        "prompt",
        "This model's maximum context length is 1024 tokens. However, your request has "
        "1030 input tokens. Please reduce the length of the input messages.",
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=[5] * 1024)
    assert e.value.status_code == 400
    assert "maximum context length is 1024 tokens" in e.value.message
    long_chat = [{"role": "user", "content": "fox " * 1100}]
    r = http.post("/v1/chat/completions", json={"messages": long_chat})
    assert_error(r, 400, "messages", "This model's maximum context length is 1024 tokens.")


def test_max_tokens_past_the_context_is_400(http):
    r = http.post("/v1/completions", json={"prompt": [5] * 1000, "max_tokens": 100})
    assert_error(
        r,
        400,
        "max_tokens",
        "maximum context length is 1024 tokens. However, you requested 1100 tokens "
        "(1000 in the messages, 100 in the completion)",
    )


def test_min_tokens_beyond_what_fits_after_the_prompt_is_400_and_the_engine_lives(http):
    """Without max_tokens the completion may fill the context; a min_tokens past that is
    the client's error (found by the API fuzzer: it once reached the engine core and
    killed it)."""
    body = {"prompt": [5] * 1000, "min_tokens": 30, "max_tokens": None}
    r = http.post("/v1/completions", json=body)
    assert_error(r, 400, "min_tokens", "30 output tokens do not fit after the 1000-token prompt")
    r = http.post("/v1/completions", json={"prompt": [5] * 1000, "min_tokens": 3, "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 3


def test_unknown_model_is_404(http, client):
    r = http.post("/v1/completions", json={"model": "gpt-9", "prompt": PROMPT})
    err = assert_error(r, 404, "model", "The model `gpt-9` does not exist.")
    assert err["code"] == "model_not_found"
    r = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
    assert_error(r, 404, "model", "gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT)


def test_unknown_route_is_404_in_openai_shape(http):
    assert_error(http.get("/v1/nothing"), 404, None)
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_tokenize_errors(http):
    assert_error(http.post("/tokenize", json={}), 400, "prompt")
    assert_error(http.post("/detokenize", json={"tokens": [1, 10**6]}), 400, "tokens", "10")
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_openai_client_raises_bad_request(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, temperature=-0.5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=MESSAGES, top_p=0)
    assert e.value.body["param"] == "top_p"


def test_server_still_serves_after_errors(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
    assert out.usage.completion_tokens <= 2
