"""Prefill/decode disaggregation end to end, as real processes on loopback: a client talks to
`tandem proxy`, which reserves on a decode instance, has a prefill instance compute the
prompt and stream its KV, and relays the decode instance's tokens. Greedy output equals a
colocated instance's; only the KV the decode side lacks crosses the wire; failures end in a
completion or a prompt error, and neither side holds a block afterwards."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.disagg.conftest import ready
from tests.server.conftest import settled

pytestmark = pytest.mark.slow
TOKEN_PROMPT_SHORT = [5, 17, 42]  # shorter than a block
TOKEN_PROMPT_LONG = [(7 * i + 3) % 300 + 5 for i in range(150)]  # many blocks


def _complete(url: str, body: dict, path: str = "/v1/completions", timeout: float = 60) -> dict:
    r = httpx.post(url + path, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(prompt, max_tokens=12, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}  # fmt: skip


def _stream(url: str, path: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Text per choice index, and every event, of a streamed answer."""
    texts: dict[int, str] = {}
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            for c in event.get("choices", []):
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts, events


def _choices(answer: dict) -> list[tuple]:
    return [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]]


def _holds_no_blocks(*servers) -> None:
    for s in servers:
        assert settled(s, "tandem:kv_cache_usage_perc", 0.0) == 0.0, s.log_path


def _bytes_per_token(server, llama_path) -> int:
    cfg = json.loads((llama_path / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * 4  # the prefill side's float32


# ---- greedy output equals a colocated instance -------------------------------------------
@pytest.mark.parametrize("prompt", [TOKEN_PROMPT_SHORT, TOKEN_PROMPT_LONG], ids=["short", "long"])
def test_greedy_completion_through_the_proxy_equals_colocated(deployments, prompt):
    ref, p, d, proxy = ready(deployments, "same")
    body = _greedy(prompt, logprobs=2)
    want, got = _complete(ref.url, body), _complete(proxy.url, body)
    assert _choices(got) == _choices(want)
    for g, w in zip(got["choices"], want["choices"]):
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
        for a, b in zip(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"]):
            assert a == pytest.approx(b, abs=1e-4)
    assert got["usage"] == want["usage"]
    assert proxy.metrics()["tandem:pd_requests_total:handoff"] >= 1
    assert "(CURVE: known prefill keys only)" in d.log()  # the KV came over the secured link
    _holds_no_blocks(p, d)


def test_streamed_chat_with_n_2_through_the_proxy_equals_colocated(deployments):
    ref, p, d, proxy = ready(deployments, "same")
    body = {"messages": [{"role": "user", "content": "Tell me about paged attention."}],
            "max_tokens": 10, "temperature": 0, "n": 2, "ignore_eos": True}  # fmt: skip
    want, _ = _stream(ref.url, "/v1/chat/completions", body)
    got, events = _stream(proxy.url, "/v1/chat/completions", body)
    assert got == want and set(got) == {0, 1}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    final = _complete(proxy.url, body, "/v1/chat/completions")
    assert [c["message"]["content"] for c in final["choices"]] == [want[0], want[1]]


def test_streamed_completions_of_two_prompts_equal_colocated(deployments):
    ref, _, _, proxy = ready(deployments, "same")
    body = _greedy([TOKEN_PROMPT_SHORT, TOKEN_PROMPT_LONG[:40]], max_tokens=8)
    want, _ = _stream(ref.url, "/v1/completions", body)
    got, _ = _stream(proxy.url, "/v1/completions", body)
    assert got == want and set(got) == {0, 1}


# ---- only the KV the decode side lacks crosses the wire --------------------------------------
def test_full_and_partial_prefix_hits_on_the_decode_side_send_only_the_rest(
    deployments, llama_path
):
    ref, _, d, proxy = ready(deployments, "same")
    per_token = _bytes_per_token(d, llama_path)
    prompt = [(11 * i + 1) % 300 + 5 for i in range(40)]

    def sent_for(tokens) -> tuple[float, float, list]:
        before = d.metrics()
        answer = _complete(proxy.url, _greedy(tokens))
        assert _choices(answer) == _choices(_complete(ref.url, _greedy(tokens)))
        time.sleep(0.2)
        after = d.metrics()
        received = after["tandem:kv_transfer_received_bytes_total"] - before.get(
            "tandem:kv_transfer_received_bytes_total", 0.0
        )
        cached = after["tandem:kv_transfer_cached_prompt_tokens_total"] - before.get(
            "tandem:kv_transfer_cached_prompt_tokens_total", 0.0
        )
        return received, cached, answer

    received, cached, _ = sent_for(prompt)  # first sight: everything is sent
    assert cached == 0 and received == len(prompt) * per_token
    received, cached, _ = sent_for(prompt)  # a full hit: all but the last block's tokens held
    assert cached == 32 and received == (len(prompt) - 32) * per_token
    longer = prompt + [(13 * i + 2) % 300 + 5 for i in range(30)]  # a partial hit
    received, cached, _ = sent_for(longer)
    assert cached == 32 and received == (len(longer) - 32) * per_token


def test_the_second_turn_of_a_conversation_sends_only_its_new_suffix(deployments, llama_path):
    _, _, d, proxy = ready(deployments, "same")
    per_token = _bytes_per_token(d, llama_path)
    turn1 = "The tool returned: " + " ".join(f"row {i} ok;" for i in range(30))
    body = {"prompt": turn1, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    before = d.metrics().get("tandem:kv_transfer_received_bytes_total", 0.0)
    answer = _complete(proxy.url, body)
    time.sleep(0.2)
    first_bytes = d.metrics()["tandem:kv_transfer_received_bytes_total"] - before
    turn2 = turn1 + answer["choices"][0]["text"] + " Next tool call: fetch row 31."
    before = d.metrics()
    answer2 = _complete(proxy.url, {**body, "prompt": turn2})
    time.sleep(0.2)
    after = d.metrics()
    second_bytes = (
        after["tandem:kv_transfer_received_bytes_total"]
        - before["tandem:kv_transfer_received_bytes_total"]
    )
    cached = (
        after["tandem:kv_transfer_cached_prompt_tokens_total"]
        - before["tandem:kv_transfer_cached_prompt_tokens_total"]
    )
    n2 = answer2["usage"]["prompt_tokens"]
    assert second_bytes == (n2 - cached) * per_token  # exactly what was not held
    assert cached >= answer["usage"]["prompt_tokens"] - 16  # the first turn, but a block
    assert second_bytes < 0.5 * n2 * per_token and second_bytes < first_bytes


def test_the_proxy_sends_a_conversation_to_the_decode_instance_that_holds_it(deployments):
    """Two decode instances: every later turn goes where the earlier ones are cached, and a
    new conversation goes to the other instance."""
    _, _, decodes, proxy = ready(deployments, "two")
    cached = "tandem:kv_transfer_cached_prompt_tokens_total"
    homes = []
    for c in range(2):
        history = f"Agent {c} log: " + " ".join(f"step {c}.{i} returned ok." for i in range(30))
        before = [d.metrics().get(cached, 0.0) for d in decodes]
        for turn in range(3):
            answer = _complete(proxy.url, _greedy(history, max_tokens=4))
            history += answer["choices"][0]["text"] + f" Observation {turn}: more rows."
        time.sleep(0.2)
        gained = [i for i, d in enumerate(decodes) if d.metrics().get(cached, 0.0) > before[i]]
        assert len(gained) == 1
        homes.append(gained[0])
    assert homes[0] != homes[1]


# ---- heterogeneous pair -------------------------------------------------------------------
def test_a_float32_block_16_prefill_and_bf16_block_8_decode_match_a_bf16_instance(deployments):
    ref, p, d, proxy = ready(deployments, "mixed")
    for prompt in (TOKEN_PROMPT_SHORT, TOKEN_PROMPT_LONG[:60]):
        assert _choices(_complete(proxy.url, _greedy(prompt))) == _choices(
            _complete(ref.url, _greedy(prompt))
        )
    _holds_no_blocks(p, d)


# ---- client aborts -------------------------------------------------------------------------
def test_a_client_that_leaves_during_the_reservation_or_the_decode_leaks_nothing(deployments):
    _, p, d, proxy = ready(deployments, "same")
    # the reservation stage, straight at the decode instance: gone once its headers are in
    body = _greedy(TOKEN_PROMPT_LONG, kv_transfer_params={"do_remote_prefill": True})
    with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and "x-tandem-kv-transfer" in r.headers
    # the decode stage: a long stream closed after a few chunks
    with httpx.stream(
        "POST", proxy.url + "/v1/completions",
        json=_greedy(TOKEN_PROMPT_LONG, max_tokens=500, stream=True), timeout=30,
    ) as r:  # fmt: skip
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    _holds_no_blocks(p, d)


def test_a_client_that_leaves_during_the_prefill_leaks_nothing(deployments):
    _, p, d, proxy = ready(deployments, "stalls")
    os.kill(p.core_pid, signal.SIGSTOP)  # the prefill stalls with the request in hand
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(proxy.url + "/v1/completions", json=_greedy(TOKEN_PROMPT_LONG), timeout=0.8)
    finally:
        os.kill(p.core_pid, signal.SIGCONT)
    _holds_no_blocks(p, d)


# ---- failures -----------------------------------------------------------------------------
def test_a_stalled_transfer_is_given_up_within_its_bound(deployments):
    """No prefill instance ever sends: the reservation fails after --kv-transfer-timeout 3."""
    _, _, d, _ = ready(deployments, "stalls")
    body = _greedy(TOKEN_PROMPT_LONG, kv_transfer_params={"do_remote_prefill": True})
    t0 = time.monotonic()
    r = httpx.post(d.url + "/v1/completions", json=body, timeout=30)
    took = time.monotonic() - t0
    assert r.status_code == 200  # sent with the reservation; the body is the error
    assert "timed out after 3 s" in r.json()["error"]["message"]
    assert 2.5 < took < 6
    assert settled(d, "tandem:kv_transfer_failures_total", 1.0) >= 1
    _holds_no_blocks(d)


def test_a_stalled_prefill_instance_falls_back_to_the_decode_instance(deployments):
    ref, p, d, proxy = ready(deployments, "stalls")
    os.kill(p.core_pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        answer = _complete(proxy.url, _greedy(TOKEN_PROMPT_LONG))  # --prefill-timeout 1.5
        took = time.monotonic() - t0
    finally:
        os.kill(p.core_pid, signal.SIGCONT)
    assert _choices(answer) == _choices(_complete(ref.url, _greedy(TOKEN_PROMPT_LONG)))
    assert 1.4 < took < 10
    assert proxy.metrics()["tandem:pd_requests_total:colocated"] >= 1
    _holds_no_blocks(p, d)


def test_kill_9_of_the_prefill_instance_mid_request_falls_back_and_completes(deployments):
    ref, p, d, proxy = ready(deployments, "stalls")
    os.kill(p.core_pid, signal.SIGSTOP)  # it takes the request, then dies holding it
    logged = proxy.log_path.stat().st_size  # what the proxy says from here on
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(answer=_complete(proxy.url, _greedy(TOKEN_PROMPT_LONG)))
    )
    t0 = time.monotonic()
    worker.start()
    time.sleep(0.5)
    os.kill(p.proc.pid, signal.SIGKILL)
    worker.join(30)
    assert _choices(result["answer"]) == _choices(_complete(ref.url, _greedy(TOKEN_PROMPT_LONG)))
    # at once, on the broken connection, not at the prefill timeout: the proxy says which
    # (a clock would say it only on an idle machine)
    log = proxy.log_path.read_bytes()[logged:].decode(errors="replace").splitlines()
    failures = [line.rpartition(": ")[2] for line in log if f"proxy: prefill {p.url}:" in line]
    assert failures and not any("Timeout" in why for why in failures), failures
    assert time.monotonic() - t0 < 30
    _holds_no_blocks(d)
    # and with the prefill instance gone, requests still complete on the decode side
    assert _choices(_complete(proxy.url, _greedy(TOKEN_PROMPT_SHORT))) == _choices(
        _complete(ref.url, _greedy(TOKEN_PROMPT_SHORT))
    )
    # and the prober reports it gone, the decode instance still there
    deadline = time.monotonic() + 10
    while proxy.healthy_instances()["prefill"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proxy.healthy_instances() == {"prefill": 0, "decode": 1}


def test_kill_9_of_the_decode_instance_mid_stream_ends_the_client_stream_promptly(deployments):
    _, p, d, proxy = ready(deployments, "dies")
    events, t_kill = [], None
    with httpx.stream(
        "POST", proxy.url + "/v1/completions",
        json=_greedy(TOKEN_PROMPT_LONG, max_tokens=800, stream=True), timeout=30,
    ) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 5 and t_kill is None:
                os.kill(d.proc.pid, signal.SIGKILL)
                t_kill = time.monotonic()
    assert t_kill is not None, events
    took = time.monotonic() - t_kill
    assert took < 5
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    _holds_no_blocks(p)
    r = httpx.post(proxy.url + "/v1/completions", json=_greedy(TOKEN_PROMPT_SHORT), timeout=30)
    assert r.status_code == 200  # no decode instance left: served on the prefill instance
