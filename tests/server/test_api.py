"""The endpoints through the official openai client and httpx: exact outputs and shapes."""

from __future__ import annotations

import asyncio
import time
from importlib import metadata

import httpx
import openai
import pytest

import tandem

PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "user", "content": "Paged attention stores keys"}]
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


def streamed_completion(client, model, **kw):
    """(text per choice, finish reasons per choice, chunks) of a streamed completion."""
    texts, reasons, chunks = {}, {}, []
    for chunk in client.completions.create(model=model, stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in reasons, "a second chunk carries finish_reason"
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def streamed_chat(client, model, **kw):
    texts, reasons, roles, chunks = {}, {}, {}, []
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            if c.index not in roles:
                roles[c.index] = c.delta.role  # the first delta of each choice
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in reasons, "a second chunk carries finish_reason"
                reasons[c.index] = c.finish_reason
    return texts, reasons, roles, chunks


def same_usage(streamed, full) -> bool:
    """The same token counts; the stream, sent second, finds at least the first's blocks
    cached."""
    details = {"prompt_tokens_details"}
    return (
        streamed.model_dump(exclude=details) == full.model_dump(exclude=details)
        and streamed.prompt_tokens_details.cached_tokens >= full.prompt_tokens_details.cached_tokens
    )


def test_completion_stream_equals_non_stream(client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    (choice,) = full.choices
    assert choice.finish_reason == "length"
    texts, reasons, chunks = streamed_completion(
        client,
        model_name,
        prompt=PROMPT,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    assert texts == {0: choice.text} and reasons == {0: "length"}
    assert chunks[-1].choices == [] and same_usage(chunks[-1].usage, full.usage)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_equals_non_stream(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, **GREEDY)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    texts, reasons, roles, chunks = streamed_chat(
        client,
        model_name,
        messages=MESSAGES,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    assert texts == {0: choice.message.content} and reasons == {0: "length"}
    assert roles == {0: "assistant"}
    assert chunks[-1].choices == [] and same_usage(chunks[-1].usage, full.usage)


def test_no_usage_chunk_without_include_usage(client, model_name):
    _, _, chunks = streamed_completion(client, model_name, prompt=PROMPT, **GREEDY)
    assert all(c.usage is None and c.choices for c in chunks)


def test_n2_with_seed_is_reproducible(client, model_name):
    kw = dict(prompt=PROMPT, n=2, seed=1234, temperature=1.0, max_tokens=16)
    kw["extra_body"] = {"ignore_eos": True}
    a = client.completions.create(model=model_name, **kw)
    b = client.completions.create(model=model_name, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # each choice has its own seed
    texts, reasons, _ = streamed_completion(client, model_name, **kw)
    assert texts == {c.index: c.text for c in a.choices}
    assert reasons == {0: "length", 1: "length"}
    assert a.usage.completion_tokens == 32 and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_n2_seed_stream_equals_non_stream(client, model_name):
    kw = dict(messages=MESSAGES, n=2, seed=7, temperature=0.8, max_tokens=12)
    full = client.chat.completions.create(model=model_name, **kw)
    texts, reasons, roles, _ = streamed_chat(client, model_name, **kw)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert roles == {0: "assistant", 1: "assistant"}
    assert set(reasons) == {0, 1}


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, model_name, stream):
    full = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY).choices[0].text
    stop = full[8:11]
    expected = full[: full.find(stop)]
    kw = dict(prompt=PROMPT, stop=[stop], temperature=0, max_tokens=24)
    if stream:
        texts, reasons, chunks = streamed_completion(client, model_name, **kw)
        assert texts == {0: expected} and reasons == {0: "stop"}
        assert stop not in "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        choice = client.completions.create(model=model_name, **kw).choices[0]
        assert choice.text == expected and choice.finish_reason == "stop"
        assert choice.model_extra["stop_reason"] == stop


def test_stream_holds_back_a_partial_stop_string(client, model_name):
    # The stop string's first characters appear in the output but the whole never does:
    # streaming must hold them back while undecided, then release them.
    full = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY).choices[0].text
    stop = full[5:8] + "\x00never"
    texts, reasons, _ = streamed_completion(client, model_name, prompt=PROMPT, stop=stop, **GREEDY)
    assert texts == {0: full} and reasons == {0: "length"}


def test_chat_stop_string(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, **GREEDY)
    text = full.choices[0].message.content
    stop = text[6:9]
    kw = dict(messages=MESSAGES, stop=stop, temperature=0, max_tokens=24)
    got = client.chat.completions.create(model=model_name, **kw).choices[0]
    assert got.message.content == text[: text.find(stop)] and got.finish_reason == "stop"
    texts, reasons, _, _ = streamed_chat(client, model_name, **kw)
    assert texts == {0: got.message.content} and reasons == {0: "stop"}


def test_completion_logprobs_shapes(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert n == 24
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4  # the top 3 plus the sampled token (keys may coincide)
        assert top[token] == chosen and chosen <= 0
        assert max(top.values()) == chosen  # greedy picks the most likely token
    # streamed logprobs cover the same tokens
    tokens = []
    for chunk in client.completions.create(
        model=model_name, prompt=PROMPT, logprobs=3, stream=True, **GREEDY
    ):
        tokens += chunk.choices[0].logprobs.tokens
    assert tokens == lp.tokens


def test_chat_logprobs_shapes(client, model_name):
    out = client.chat.completions.create(
        model=model_name, messages=MESSAGES, logprobs=True, top_logprobs=4, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 24
    for entry in content:
        assert len(entry.top_logprobs) == 4
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_usage_counts_equal_the_tokenizer(client, model_name, tokenizer):
    out = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    assert out.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    assert out.usage.completion_tokens == 24 and out.usage.total_tokens == 24 + len(
        tokenizer(PROMPT).input_ids
    )
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, **GREEDY)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert chat.usage.prompt_tokens == len(ids)
    # n > 1: the prompt counted once, completions summed
    two = client.completions.create(model=model_name, prompt=PROMPT, n=2, **GREEDY)
    assert two.usage.prompt_tokens == out.usage.prompt_tokens
    assert two.usage.completion_tokens == 48


def test_list_of_prompts_and_token_ids(client, model_name, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    single = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    out = client.completions.create(model=model_name, prompt=[PROMPT, "Héllo wörld"], **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == single.choices[0].text
    by_ids = client.completions.create(model=model_name, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == single.choices[0].text
    batch = client.completions.create(model=model_name, prompt=[ids, ids[:3]], n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 3
    texts, reasons, _ = streamed_completion(
        client, model_name, prompt=[PROMPT, "Héllo wörld"], **GREEDY
    )
    assert texts == {c.index: c.text for c in out.choices} and set(reasons) == {0, 1}


def test_echo_prepends_the_prompt(client, model_name):
    plain = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY).choices[0].text
    echoed = client.completions.create(model=model_name, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain
    texts, _, _ = streamed_completion(client, model_name, prompt=PROMPT, echo=True, **GREEDY)
    assert texts == {0: PROMPT + plain}


def test_default_max_tokens_is_16_for_completions(client, model_name):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_sampling_fields_are_accepted(client, model_name):
    out = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        extra_body=dict(
            top_k=20, min_p=0.05, repetition_penalty=1.2, min_tokens=4, priority=1,
            stop_token_ids=[2], ignore_eos=False,
        ),
    )  # fmt: skip
    assert 4 <= out.usage.completion_tokens <= 8
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_completion_tokens=5, temperature=0
    )
    assert chat.usage.completion_tokens <= 5


def test_32_concurrent_greedy_requests_equal_sequential(server, model_name):
    prompts = [PROMPT[: 5 + i] + f" {i}" for i in range(32)]
    kw = dict(model=model_name, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    sync = openai.OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)
    sequential = [sync.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def concurrent():
        aclient = openai.AsyncOpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0)

        async def one(i, p):
            if i % 2:  # half of them streamed
                text = ""
                async for chunk in await aclient.completions.create(prompt=p, stream=True, **kw):
                    text += chunk.choices[0].text
                return text
            return (await aclient.completions.create(prompt=p, **kw)).choices[0].text

        async with aclient:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(concurrent()) == sequential


def test_models_health_version(client, http, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert models.data[0].model_extra["max_model_len"] == 1024
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    version = http.get("/version").json()
    assert version["version"] == tandem.__version__ == metadata.version("tandem")
    # which process answers (a router tells a restarted worker by it): stable while it runs
    assert version["instance_id"] == health.json()["instance_id"] != ""
    assert 0 < time.time() - version["started"] < 3600


def test_tokenize_and_detokenize(http, tokenizer, model_name):
    r = http.post("/tokenize", json={"model": model_name, "prompt": PROMPT}).json()
    assert r["tokens"] == tokenizer(PROMPT).input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert chat["tokens"] == list(ids)
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}


def test_metrics_have_vllm_names(server, client, model_name):
    before = server.metrics()
    out = client.completions.create(model=model_name, prompt=PROMPT, **GREEDY)
    after = server.metrics()
    for name in [
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
        "prompt_tokens_total", "generation_tokens_total",
        "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
        "engine_steps_total", "engine_execute_seconds_total", "engine_execute_cpu_seconds_total",
    ]:  # fmt: skip
        assert f"tandem:{name}" in after, name
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["tandem:prompt_tokens_total"] == out.usage.prompt_tokens
    assert delta["tandem:generation_tokens_total"] == 24
    assert delta["tandem:request_success_total:length"] == 1
    assert delta["tandem:e2e_request_latency_seconds_count"] == 1
    assert delta["tandem:time_to_first_token_seconds_count"] == 1
    assert delta["tandem:inter_token_latency_seconds_count"] == 23
    assert delta["tandem:engine_steps_total"] == 24  # the prompt's step and 23 decodes
    assert delta["tandem:engine_execute_seconds_total"] > 0
    assert delta["tandem:engine_execute_cpu_seconds_total"] > 0
    assert after["tandem:num_requests_running"] == 0
    assert after["tandem:kv_cache_usage_perc"] == 0


def test_health_and_metrics_are_plain_http(server):
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
