"""KV tiers behind real servers: two instances share one real redis-server; the second
reuses a prefix the first computed, /metrics counts it per tier, and a redis-server killed
with SIGKILL mid-service costs hits, never requests."""

from __future__ import annotations

import time

import httpx
import redis

from tests.server.conftest import Server, metrics

PROMPT = [40 + (7 * i) % 150 for i in range(300)]  # token ids: no tokenizer surprises


def complete(server: Server, prompt: list[int]) -> list[int]:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def tier_metrics(server: Server) -> dict[str, float]:
    return metrics(server.url, "tier")


def test_a_second_instance_loads_a_prefix_the_first_computed(llama_path, tmp_path, redis_server):
    args = [
        "--kv-remote-url",
        redis_server.url,
        "--block-size",
        "16",
        "--kv-offload-min-tokens",
        "64",
    ]
    a = Server(llama_path, args, tmp_path, "a")
    b = Server(llama_path, [*args, "--kv-offloading-size", "0.01"], tmp_path, "b")
    try:
        a.wait_ready(), b.wait_ready()
        assert "KV tiers: redis" in a.log() and "KV tiers: host, redis" in b.log()
        want = complete(a, PROMPT)
        client = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 10  # the store is written behind the step
        while client.dbsize() < 18:
            assert time.monotonic() < deadline, "instance a never stored its KV"
            time.sleep(0.1)
        assert complete(b, PROMPT) == want
        m = tier_metrics(b)
        assert (
            m["tandem:kv_offload_loaded_tokens_total"] == 288
        )  # 18 blocks of 16: all but the last
        assert (
            m["tandem:kv_offload_hits_total:redis"] == 18
            and m["tandem:kv_offload_lookup_hits_total"] == 1
        )
        assert m["tandem:kv_offload_loaded_bytes_total:redis"] > 0
        assert m["tandem:kv_offload_load_seconds_count"] == 1

        redis_server.kill()  # SIGKILL, then requests go on: misses, no errors
        other = [p + 1 for p in PROMPT]
        for server in (a, b):
            assert complete(server, other)
        assert tier_metrics(a)["tandem:kv_offload_errors_total:redis"] >= 1
        redis_server.start()  # back on the same port, empty
        time.sleep(5.5)  # the tier's retry period
        third = [p + 2 for p in PROMPT]
        complete(a, third)
        deadline = time.monotonic() + 10
        while True:
            before = tier_metrics(b).get("tandem:kv_offload_hits_total:redis", 0)
            complete(b, third)
            if tier_metrics(b)["tandem:kv_offload_hits_total:redis"] > before:
                break  # b loaded what a stored after the restart
            assert time.monotonic() < deadline, "the restarted Redis was never used again"
            time.sleep(0.5)
            third = [p + 1 for p in third]
            complete(a, third)
            time.sleep(0.3)
    finally:
        a.stop(), b.stop()
