"""Instances that switch between prefill and decode without a restart, as real processes on
loopback: `POST /role` on a worker started with --enable-role-switching, and the router
moving one between its pools by itself (--pd-ratio auto). Greedy output stays a colocated
instance's; the KV a switched instance cached in its old role still saves a transfer."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.disagg.conftest import ProxyProcess
from tests.server.conftest import Server, metrics

pytestmark = pytest.mark.slow
SWITCH = ["--enable-role-switching"]
PROMPT = [(11 * i + 1) % 300 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def instances(llama_path, tmp_path_factory):
    """a: prefill, b and c: decode, all three able to switch; started at once."""
    logs = tmp_path_factory.mktemp("role-logs")
    servers = {"a": Server(llama_path, ["--role", "prefill", *SWITCH], logs, "a"),
               "b": Server(llama_path, ["--role", "decode", *SWITCH], logs, "b"),
               "c": Server(llama_path, ["--role", "decode", *SWITCH], logs, "c")}  # fmt: skip
    yield servers, logs
    for s in servers.values():
        s.terminate()
    for s in servers.values():
        s.stop()


def _greedy(prompt, max_tokens=12) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _text(url: str, body: dict) -> str:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _switch(server, role: str) -> dict:
    r = httpx.post(server.url + "/role", json={"role": role}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _role(server) -> str:
    return httpx.get(server.url + "/role", timeout=10).json()["role"]


def test_a_switched_pair_hands_off_the_other_way_and_keeps_its_cache(instances):
    servers, logs = instances
    a, b = servers["a"].wait_ready(), servers["b"].wait_ready()
    forward = ProxyProcess([a], [b], logs, "forward").wait_ready()
    try:
        first = _text(forward.url, _greedy(PROMPT))  # a computes the prompt, b decodes
        assert forward.metrics().get("tandem:pd_requests_total:handoff") == 1
    finally:
        forward.stop()
    assert _switch(a, "decode") == {"role": "decode", "previous": "prefill"}
    assert _switch(b, "prefill") == {"role": "prefill", "previous": "decode"}
    assert (_role(a), _role(b)) == ("decode", "prefill")
    assert metrics(a.url, "role").get("tandem:role_switches_total:decode") == 1
    # its old role's requests are now turned away as busy, so a router tries another
    r = httpx.post(a.url + "/v1/completions", timeout=10, json={
        **_greedy(PROMPT), "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    assert r.status_code == 503 and "now serves the decode role" in r.text
    backward = ProxyProcess([b], [a], logs, "backward").wait_ready()
    try:
        before = metrics(a.url, "kv_transfer")
        assert _text(backward.url, _greedy(PROMPT)) == first  # b computes, a decodes
        assert backward.metrics().get("tandem:pd_requests_total:handoff") == 1
        time.sleep(0.2)
        after = metrics(a.url, "kv_transfer")
    finally:
        backward.stop()
    # a cached the prompt while it was the prefill side: as the decode side it holds all but
    # the last block (blocks of 16), so only the rest crossed the link
    cached = after["tandem:kv_transfer_cached_prompt_tokens_total"] - before.get(
        "tandem:kv_transfer_cached_prompt_tokens_total", 0.0)  # fmt: skip
    assert cached == 32
    assert _text(servers["c"].wait_ready().url, _greedy(PROMPT)) == first  # colocated


def test_a_bad_role_is_a_400_naming_the_field(instances):
    a = instances[0]["a"].wait_ready()
    for body in ({"role": "both"}, {"role": 3}, {}):
        r = httpx.post(a.url + "/role", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text


def test_the_router_moves_a_decode_instance_to_a_pressed_prefill_pool(instances):
    servers, logs = instances
    for s in servers.values():
        s.wait_ready()
    prefill = [s for s in servers.values() if _role(s) == "prefill"]
    decode = [s for s in servers.values() if _role(s) == "decode"]
    assert (len(prefill), len(decode)) == (1, 2)
    # any prompt queued on the one prefill instance is over a 1 ms TTFT target; one move only
    args = ("--pd-ratio", "auto", "--pd-ttft-target", "0.001", "--pd-sustain", "0",
            "--pd-cooldown", "600")  # fmt: skip
    router = ProxyProcess(prefill, decode, logs, "auto", args).wait_ready()
    prompts = [[(7 * i + k) % 300 + 5 for i in range(120)] for k in range(4)]
    want = {k: _text(servers["a"].url, _greedy(p, 8)) for k, p in enumerate(prompts)}
    got, errors = {}, []

    def client(k: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _moved(router) == 0:
            try:
                got[k] = _text(router.url, _greedy(prompts[k], 8))
            except AssertionError as e:
                errors.append(str(e))
        got[k] = _text(router.url, _greedy(prompts[k], 8))  # after the move, too

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert _moved(router) == 1, (logs / "auto.log").read_text()
        assert errors == [] and got == want
        roles = sorted(_role(s) for s in servers.values())
        assert roles == ["decode", "prefill", "prefill"]
        healthy = router.healthy_instances()
        assert healthy == {"prefill": 2, "decode": 1}
    finally:
        router.stop()


def _moved(router) -> float:
    return metrics(router.url, "outcome").get("tandem:pd_role_moves_total:moved", 0.0)
