"""What a hostile client sends: every malformed request is a 400 naming the field, and none
of them hurts the engine, leaks a request or holds a KV block."""

from __future__ import annotations

import json
import time

import pytest

from tests.server.test_errors import assert_error

CHAT = [{"role": "user", "content": "hi"}]
BIG = 2**70  # past 64 bits
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path, body, param, fragment",
    [
        ("/v1/completions", {"prompt": ""}, "prompt", "must not be empty"),
        ("/v1/completions", {"prompt": [""]}, "prompt", "must not be empty"),
        ("/v1/completions", {"prompt": ["", "hi"]}, "prompt", "must not be empty"),
        ("/v1/completions", {"prompt": "", "stream": True}, "prompt", "must not be empty"),
        ("/v1/completions", {"prompt": "hi", "top_k": 2**63, "temperature": 1}, "top_k", "less"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [100000], "min_tokens": 2},
         "stop_token_ids", "[0, 400)"),
        ("/v1/completions", {"prompt": "hi", "seed": BIG}, "seed", "less"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**63 - 1, "n": 2}, "seed", "64-bit"),
        ("/v1/completions", {"prompt": "hi", "priority": BIG}, "priority", "less"),
        ("/v1/completions", {"prompt": "hi", "top_k": BIG}, "top_k", "less"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [BIG]}, "stop_token_ids", "less"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": BIG, "max_tokens": None},
         "min_tokens", "less"),
        ("/v1/completions", {"prompt": [BIG]}, "prompt", "out of range"),
        ("/v1/completions", {"prompt": "hi", "n": 10**7}, "n", "[1, 256]"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "max_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs":
         {"return_tensors": "pt"}}, "chat_template_kwargs", "return_tensors"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools",
         "field required"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice",
         "needs tools"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL]}, "tool_choice",
         "--enable-auto-tool-choice"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL], "tool_choice":
         {"type": "function", "function": {"name": "g"}}}, "tool_choice", "no tool named 'g'"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL], "tool_choice": "required",
         "stream": True, "n": 2}, "n", "n = 1"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL], "tool_choice": "required",
         "guided_regex": "a"}, "tool_choice", "drop guided_regex"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function":
         {"name": "f", "parameters": {"type": 5}}}]}, "tools", "invalid JSON schema"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
         "response_format", "schema: field required"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}},
         "response_format", "json_schema"),
        ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "strnig"}}, "guided_json",
         "invalid JSON schema"),
        ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice", "non-empty"),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex",
         "invalid regex"),
        ("/v1/completions", {"prompt": "hi", "guided_choice": ["a"], "guided_regex": "a"},
         "guided_choice", "one way"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}, "structured_outputs",
         "exactly one"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
         "top_logprobs", "max_logprobs"),
        ("/detokenize", {"tokens": [BIG]}, "tokens", "less"),
    ],
)  # fmt: skip
def test_a_malformed_request_is_400_naming_its_field(http, path, body, param, fragment):
    assert_error(http.post(path, json={"max_tokens": 3, **body}), 400, param, fragment)


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 3}', "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages"),
        ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),
        ("/v1/completions", b'{"prompt": "hi", "user": ' + b"[" * 100 + b"]" * 100 + b"}",
         "user"),
    ],
)  # fmt: skip
def test_lone_surrogates_and_deep_nesting_are_400(http, path, raw, param):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, param)


def test_top_k_beyond_the_vocabulary_means_no_limit(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "top_k": 2**63 - 1,
                                           "temperature": 1.0, "seed": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_stop_token_ids_with_min_tokens_in_the_vocabulary_work(http):
    body = {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [399]}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 2


def test_after_every_bad_request_the_engine_is_healthy_and_holds_nothing(server, http):
    for body in ({"prompt": ""}, {"prompt": "hi", "seed": BIG}, {"prompt": [BIG]},
                 {"prompt": "hi", "top_k": 2**63, "temperature": 1}):  # fmt: skip
        assert http.post("/v1/completions", json=body).status_code == 400
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    m = server.metrics()
    assert m["tandem:num_requests_waiting"] == 0 and m["tandem:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_created_is_the_request_time(http, stream):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": CHAT})):  # fmt: skip
        before = time.time()
        r = http.post(path, json={**body, "max_tokens": 2, "stream": stream})
        assert r.status_code == 200
        docs = (
            [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
            if stream
            else [r.json()]
        )
        assert docs and all(before - 1 <= d["created"] <= time.time() + 1 for d in docs)


def test_ping_answers_like_health_and_metrics_have_no_created_series(http):
    assert http.get("/ping").status_code == 200
    assert "_created" not in http.get("/metrics").text


def test_openapi_document_describes_the_request_bodies(http):
    doc = http.get("/openapi.json").json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"prompt", "max_tokens", "temperature", "seed"} <= set(schema["properties"])
    assert "/v1/chat/completions" in doc["paths"] and "/tokenize" in doc["paths"]


def test_without_its_flag_the_role_switch_is_off_and_the_role_reads(http):
    r = http.post("/role", json={"role": "decode"})
    assert r.status_code == 403 and "--enable-role-switching" in r.json()["error"]["message"]
    assert http.get("/role").json() == {"role": "both", "switchable": False}


def test_without_an_admin_key_the_lora_endpoints_are_off(http, tmp_path):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = http.post(path, json={"lora_name": "a", "lora_path": str(tmp_path)})
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
