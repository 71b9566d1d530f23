"""The tool measures what the server did: a real HTTP server streams with scripted delays,
and TTFT, TPOT, ITL, E2E, goodput and SLO attainment come out as scripted."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tandem.bench import metrics
from tandem.bench.client import RequestSpec
from tandem.bench.runner import RunConfig, run_workload
from tandem.bench.workloads import BenchRequest, Session
from tests.bench.scripted_server import ScriptedServer

# The server stamps each token with the time it sent it (same clock as the client), so the
# tests compare what the tool measured with what the server did. Causality is exact: the
# tool cannot see a token before the server sent it (EPS: float rounding of the stamps), and
# a tool that counted a token early or late breaks it. Delivery over loopback and the client
# waking up to read take what the machine gives (SLACK, generous: a loaded 2-core machine is
# slow, and that is the machine, not the tool); so does the server's own pace.
EPS = 1e-3  # seconds
SLACK = 0.1  # seconds


def sent_times(r) -> list[float]:
    """When the server sent each token of a request, from the stamps in its text."""
    return [float(x) for x in r.generated_text.split()]


FAST = "ttft=0.05 itl=0.01 tokens=10"  # e2e 0.14 s
SLOW = "ttft=0.30 itl=0.04 tokens=6"  # e2e 0.50 s


def run(server, requests, chat=False, count_tokens=None, **cfg):
    spec = RequestSpec(
        url=server.url + ("/v1/chat/completions" if chat else "/v1/completions"),
        model="scripted",
        chat=chat,
    )
    sessions = [Session(tuple(r)) if isinstance(r, list) else Session((r,)) for r in requests]
    return asyncio.run(run_workload(sessions, spec, RunConfig(progress=False, **cfg), count_tokens))


def req(prompt, cls="default", out=16):
    return BenchRequest(prompt=prompt, prompt_len=3, output_len=out, cls=cls)


@pytest.fixture(scope="module")
def server():
    with ScriptedServer() as s:
        run(s, [req("ttft=0 itl=0 tokens=2")])  # warm up: imports, first connection
        yield s


@pytest.fixture(scope="module")
def fast_slow(server):
    return run(server, [req(FAST, "fast"), req(SLOW, "slow"), req(FAST, "fast"), req(SLOW, "slow")])


def test_each_request_is_timed_as_the_server_sent_it(fast_slow):
    assert len(fast_slow.results) == 4
    for r in fast_slow.results:
        ttft, itl, n = (0.05, 0.01, 10) if r.cls == "fast" else (0.30, 0.04, 6)
        assert r.success and r.error == ""
        assert r.output_len == n  # from the stream's usage
        assert r.cached_tokens == 3  # its prompt_tokens_details
        sent = sent_times(r)
        # the server followed its script (late at worst) ...
        assert ttft <= sent[0] - r.start_time <= ttft + SLACK
        assert all(itl - SLACK <= b - a <= itl + SLACK for a, b in zip(sent, sent[1:]))
        # ... and the tool measured what it did: each token seen after it was sent
        assert len(r.itl) == n - 1
        seen = np.cumsum([r.start_time + r.ttft, *r.itl])
        assert all(t - EPS <= s <= t + SLACK for s, t in zip(seen, sent)), [s - t for s, t in zip(seen, sent)]  # fmt: skip
        assert r.latency == pytest.approx(seen[-1] - r.start_time)
        assert metrics.tpot(r) == pytest.approx((seen[-1] - seen[0]) / (n - 1))


def test_run_summary_uses_vllm_keys_and_measured_values(fast_slow):
    rs = fast_slow.results
    s = metrics.summarize(rs, fast_slow.duration, percentiles=(90, 99))
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["total_output_tokens"] == 32
    assert s["total_input_tokens"] == 4 * 7  # the server's usage.prompt_tokens
    ttfts = [sent_times(r)[0] - r.start_time for r in rs]
    e2els = [sent_times(r)[-1] - r.start_time for r in rs]
    ms = 1000  # the summary is of what the tool measured, each within delivery of the send
    assert s["mean_ttft_ms"] == pytest.approx(np.mean([r.ttft for r in rs]) * ms)
    assert np.mean(ttfts) * ms - EPS * ms <= s["mean_ttft_ms"] <= (np.mean(ttfts) + SLACK) * ms
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile([r.ttft for r in rs], 99) * ms)
    assert np.mean(e2els) * ms - EPS * ms <= s["mean_e2el_ms"] <= (np.mean(e2els) + SLACK) * ms
    # TPOT: 10 ms for the fast pair, 40 for the slow; ITL: 18 gaps of 10 ms, 10 of 40
    assert 10 < s["median_tpot_ms"] < 40 + SLACK * ms / 5
    assert s["median_itl_ms"] == pytest.approx(np.median([g for r in rs for g in r.itl]) * ms)
    assert 10 - SLACK * ms / 5 < s["median_itl_ms"] < 40
    # all four were sent at once (rate inf) and the slow ones set the duration
    assert 0.5 <= fast_slow.duration <= 0.5 + SLACK
    assert s["max_concurrent_requests"] == 4
    assert s["request_throughput"] == pytest.approx(4 / fast_slow.duration)
    for key in ("output_throughput", "total_token_throughput", "p90_itl_ms", "std_e2el_ms"):
        assert key in s


def test_goodput_counts_requests_meeting_every_slo(fast_slow):
    d = fast_slow.duration
    slo = metrics.parse_slos(["ttft:150", "tpot:100"])  # fast meets both; slow misses TTFT
    assert metrics.summarize(fast_slow.results, d, goodput=slo)[
        "request_goodput"
    ] * d == pytest.approx(2)
    both = metrics.parse_slos(["ttft:400", "tpot:100", "e2el:1000"])  # all four are good
    assert metrics.summarize(fast_slow.results, d, goodput=both)[
        "request_goodput"
    ] * d == pytest.approx(4)
    tight = metrics.parse_slos(["tpot:20"])  # slow's 40 ms TPOT misses
    assert metrics.summarize(fast_slow.results, d, goodput=tight)[
        "request_goodput"
    ] * d == pytest.approx(2)
    assert metrics.summarize(fast_slow.results, d)["request_goodput"] is None


def test_attainment_per_class_counts_failures_as_missed(server):
    out = run(
        server,
        [req(FAST, "chat"), req(SLOW, "chat"), req(SLOW, "batch"), req("status=500", "batch")],
    )
    class_slos = {"chat": {"ttft": 150.0}, "batch": {"e2el": 2000.0}}
    att = metrics.attainment(out.results, class_slos)
    assert att["chat"] == {"requests": 2, "good": 1, "attainment": 0.5, "met": {"ttft": 1}}
    assert att["batch"] == {"requests": 2, "good": 1, "attainment": 0.5, "met": {"e2el": 1}}
    assert att["all"] == {"requests": 4, "good": 2, "attainment": 0.5,
                          "met": {"ttft": 1, "e2el": 1}}  # fmt: skip
    s = metrics.summarize(out.results, out.duration)
    assert s["completed"] == 3 and s["failed"] == 1
    failed = [r for r in out.results if not r.success]
    assert failed[0].error.startswith("HTTP 500")
    # a class without SLOs of its own falls back to the run's
    att = metrics.attainment(out.results, {"chat": {"ttft": 150.0}}, default_slo={"ttft": 10.0})
    assert att["batch"]["good"] == 0


def test_chat_ttft_waits_for_text_not_the_role_chunk(server):
    out = run(server, [req("ttft=0.2 itl=0.01 tokens=3 role=1")], chat=True)
    (r,) = out.results
    sent = sent_times(r)
    assert len(sent) == 3 and r.output_len == 3
    assert 0.2 <= sent[0] - r.start_time - EPS <= r.ttft <= sent[0] - r.start_time + SLACK


def test_without_usage_output_tokens_are_counted_from_text(server):
    out = run(
        server, [req("ttft=0.01 itl=0.01 tokens=5 usage=0")], count_tokens=lambda t: len(t.split())
    )
    assert out.results[0].output_len == 5
    assert out.results[0].cached_tokens is None  # nothing said: not a guess of 0


def test_a_conversation_sends_its_turns_in_order(server):
    turns = [req("ttft=0.1 itl=0.01 tokens=3"), req("ttft=0.05 itl=0.01 tokens=3")]
    out = run(server, [turns, turns], max_concurrency=1)
    first, second, third, fourth = out.results
    for a, b in ((first, second), (second, third), (third, fourth)):
        assert b.start_time >= a.start_time + a.latency  # one open request at a time
    assert metrics.peak_concurrency(out.results) == 1


def test_poisson_arrivals_send_each_request_at_its_time(server):
    from tandem.bench.arrivals import arrival_times

    out = run(server, [req("ttft=0.01 itl=0.01 tokens=2")] * 6, request_rate=20.0, seed=1)
    sent = [r.start_time - out.start for r in out.results]
    due = arrival_times(6, 20.0, seed=1)
    assert due[-1] == pytest.approx(6 / 20.0)  # the last arrival at n / rate
    assert all(d <= s <= d + SLACK for s, d in zip(sent, due)), [s - d for s, d in zip(sent, due)]


def test_duration_closed_loop_keeps_concurrency_busy(server):
    out = run(server, [req("ttft=0.02 itl=0.01 tokens=3")], duration=0.5, max_concurrency=2)
    assert 2 * 0.5 / 0.05 * 0.5 < len(out.results) <= 2 * 0.5 / 0.04 + 2
    assert metrics.peak_concurrency(out.results) <= 2


def test_payloads_for_completions_and_chat():
    from tandem.bench.client import build_payload

    r = BenchRequest(prompt="hi", prompt_len=1, output_len=8, priority=2)
    spec = RequestSpec(url="u", model="m", ignore_eos=True, extra_body={"top_k": 1})
    assert build_payload(spec, r) == {
        "model": "m", "max_tokens": 8, "prompt": "hi", "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": 8,
        "priority": 2, "top_k": 1,
    }  # fmt: skip
    chat = build_payload(RequestSpec(url="u", model="m", chat=True), r)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat
    assert "ignore_eos" not in chat and "min_tokens" not in chat
