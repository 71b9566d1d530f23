"""`tandem serve --speculative-config`: the same answers as without it, streamed or not, and
vLLM's spec_decode counters on /metrics, which `tandem bench` turns into an acceptance rate."""

from __future__ import annotations

import asyncio

import httpx

from tandem.bench.server_counters import read_spec_counters, spec_summary
from tests.engine.test_spec_decode import repetitive_prompts
from tests.server.conftest import metrics, streamed_text


def complete(url: str, model: str, prompt, stream: bool) -> list[int] | str:
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0,
            "stream": stream}  # fmt: skip
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    return streamed_text(url, body)


def test_answers_equal_the_plain_servers_streamed_or_not(server, spec_server, model_name):
    before = read(spec_server)
    for prompt in repetitive_prompts():
        want = complete(server.url, model_name, prompt, stream=False)
        assert complete(spec_server.url, model_name, prompt, stream=False) == want
        assert complete(spec_server.url, model_name, prompt, stream=True) == want
    after = read(spec_server)
    summary = spec_summary(before, after)
    assert summary["spec_decode_num_accepted_tokens"] > 0
    assert 0 < summary["spec_decode_acceptance_rate"] <= 1
    assert "speculative decoding: ngram (k=4, n=2..4)" in spec_server.log()


def read(server) -> dict:
    return asyncio.run(read_spec_counters(server.url, {}))


def test_metrics_carry_vllms_spec_decode_counters(spec_server, model_name):
    complete(spec_server.url, model_name, repetitive_prompts()[3], stream=False)
    m = metrics(spec_server.url, "position")
    drafts, drafted = (
        m["tandem:spec_decode_num_drafts_total"],
        m["tandem:spec_decode_num_draft_tokens_total"],
    )
    accepted = m["tandem:spec_decode_num_accepted_tokens_total"]
    assert 0 < drafts <= drafted and 0 < accepted <= drafted
    per_pos = [
        m.get(f"tandem:spec_decode_num_accepted_tokens_per_pos_total:{i}", 0) for i in range(4)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_a_server_without_speculation_reports_no_acceptance(server):
    assert spec_summary(read(server), read(server)) == {}
