"""KV tiers end to end with a real model: greedy output identical with tiers on and off,
prefixes reused across a restart (disk) and across instances (one real Redis), a dead Redis
costing nothing but hits, and a different model never matching."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 6 "users", each a 48-token context after a shared 16-token system prompt; the pool holds
# 24 blocks of 4 (96 tokens): two users' contexts at most, so later rounds find theirs gone.
SYSTEM = list(range(40, 56))
USERS = [SYSTEM + [(11 * u + j) % 180 + 60 for j in range(48)] for u in range(6)]
POOL = dict(dtype="float32", block_size=4, num_kv_blocks=24, kv_offload_min_tokens=8)


def rounds(llm, n=2):
    """Each user asks twice: round 2's prompt extends round 1's."""
    outs = []
    for r in range(n):
        for u, ctx in enumerate(USERS):
            o = llm.generate([ctx + [7 + r, 9, u + 3]], GREEDY, use_tqdm=False)[0]
            outs.append((o.outputs[0].token_ids, o.num_cached_tokens))
            llm.engine.scheduler.check_invariants()
    return outs


@pytest.fixture(scope="module")
def without_tiers(llama_path):
    return rounds(LLM(str(llama_path), **POOL))


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_greedy_output_is_identical_with_each_tier_on_and_off(
    llama_path, without_tiers, tier, tmp_path, request
):
    flags = {
        "host": dict(kv_offloading_size=0.05),
        "disk": dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_size=0.05),
    }.get(tier)
    if tier == "redis":
        flags = dict(kv_remote_url=request.getfixturevalue("redis_server").url)
    llm = LLM(str(llama_path), **POOL, **flags)
    with_tiers = rounds(llm)
    assert [t for t, _ in with_tiers] == [t for t, _ in without_tiers]
    loads = llm.engine.stats().kv_tier_loads
    assert loads.loaded_tokens > 0 and loads.timeouts == 0
    # every user's round-2 prompt found its context (52 of 67 tokens cached or loaded)
    assert [c for _, c in with_tiers[6:]] == [64] * 6
    assert sum(c for _, c in without_tiers[6:]) < 64 * 6
    (tier_stats,) = llm.engine.stats().kv_tiers
    assert tier_stats.name == tier and tier_stats.hits > 0 and tier_stats.bytes_stored > 0


def test_an_eight_bit_cache_stores_and_loads_its_own_bytes(llama_path):
    args = dict(POOL, kv_cache_dtype="int8")
    off = rounds(LLM(str(llama_path), **args))
    llm = LLM(str(llama_path), **args, kv_offloading_size=0.05)
    on = rounds(llm)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert llm.engine.stats().kv_tier_loads.loaded_tokens > 0


def test_a_restarted_server_hits_its_disk_tier_on_its_first_request(llama_path, tmp_path):
    flags = dict(POOL, kv_disk_dir=str(tmp_path / "kv"))
    first = LLM(str(llama_path), **flags)
    want = first.generate([USERS[0] + [1, 2]], GREEDY, use_tqdm=False)[0]
    first.engine.kv_tiers.flush()
    restarted = LLM(str(llama_path), **flags)
    got = restarted.generate([USERS[0] + [3]], GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 64  # all of the shared 64 tokens, loaded
    again = restarted.generate([USERS[0] + [1, 2]], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_second_instance_reuses_what_the_first_stored_in_redis(llama_path, redis_server):
    flags = dict(POOL, kv_remote_url=redis_server.url)
    a, b = LLM(str(llama_path), **flags), LLM(str(llama_path), **flags)
    want = a.generate([USERS[1] + [5]], GREEDY, use_tqdm=False)[0]
    a.engine.kv_tiers.flush()
    got = b.generate([USERS[1] + [5]], GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 64
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_another_model_never_matches_a_shared_tier(checkpoints, tmp_path):
    flags = dict(POOL, kv_disk_dir=str(tmp_path / "kv"))
    llama = LLM(str(checkpoints["llama"]), **flags)
    llama.generate([USERS[2] + [5]], GREEDY, use_tqdm=False)
    llama.engine.kv_tiers.flush()
    assert len(llama.engine.kv_tiers.tiers[0]) > 0
    qwen = LLM(str(checkpoints["qwen2"]), **flags)
    out = qwen.generate([USERS[2] + [5]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert qwen.engine.stats().kv_tier_loads.lookup_hits == 0


def test_a_killed_redis_costs_hits_not_requests(llama_path, redis_server, without_tiers):
    llm = LLM(str(llama_path), **POOL, kv_remote_url=redis_server.url)
    llm.generate([USERS[0] + [1]], GREEDY, use_tqdm=False)
    redis_server.kill()
    outs = rounds(llm)  # every lookup and store fails fast; the answers do not change
    assert [t for t, _ in outs] == [t for t, _ in without_tiers]
    assert llm.engine.stats().kv_tiers[0].errors >= 1


def test_a_corrupt_disk_entry_is_computed_instead(llama_path, tmp_path):
    flags = dict(POOL, kv_disk_dir=str(tmp_path / "kv"))
    first = LLM(str(llama_path), **flags)
    want = first.generate([USERS[3] + [4]], GREEDY, use_tqdm=False)[0]
    first.engine.kv_tiers.flush()
    files = sorted((tmp_path / "kv").glob("*.kv"))
    for f in files:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x55  # every entry's last byte changed
        f.write_bytes(bytes(data))
    restarted = LLM(str(llama_path), **flags)
    got = restarted.generate([USERS[3] + [4]], GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens == 0  # looked up, loaded nothing sound, computed
    assert restarted.engine.stats().kv_tiers[0].misses > 0
