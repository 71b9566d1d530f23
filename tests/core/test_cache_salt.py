"""cache_salt (vLLM's): requests share cached KV only with requests of the same salt, so a
tenant can never see another's prompts through cache hits. No torch."""

from __future__ import annotations

from tandem.core.block_hash import BlockHasher, model_seed
from tests.core.harness import Harness


def test_the_same_prompt_under_another_salt_matches_nothing_in_the_prefix_cache():
    h = Harness(block_size=4)
    prompt = list(range(100, 113))
    first = h.add(prompt, cache_salt="tenant-a")
    h.run_to_completion()
    assert first.num_cached_tokens == 0
    for salt, cached in (("tenant-b", 0), (None, 0), ("tenant-a", 12), ("tenant-a ", 0)):
        r = h.add(prompt, cache_salt=salt)
        h.run_to_completion()
        assert r.num_cached_tokens == cached, f"salt {salt!r}"
    h.assert_pool_whole()


def test_unsalted_requests_keep_sharing_among_themselves():
    h = Harness(block_size=4)
    prompt = list(range(200, 209))
    h.add(prompt)
    h.run_to_completion()
    again = h.add(prompt)
    h.run_to_completion()
    assert again.num_cached_tokens == 8
    h.assert_pool_whole()


def test_a_salt_and_an_adapter_together_share_only_with_both_the_same():
    h = Harness(block_size=4)
    prompt = list(range(300, 309))
    h.add(prompt, lora_id=1, cache_salt="t")
    h.run_to_completion()
    for lora_id, salt, cached in ((1, None, 0), (0, "t", 0), (2, "t", 0), (1, "t", 8)):
        r = h.add(prompt, lora_id=lora_id, cache_salt=salt)
        h.run_to_completion()
        assert r.num_cached_tokens == cached, (lora_id, salt)


def test_purging_an_adapter_drops_its_salted_blocks_too_and_nothing_else():
    h = Harness(block_size=4)
    prompt = list(range(400, 409))
    for lora_id, salt in ((1, "t"), (1, None), (2, "t"), (0, "t")):
        h.add(prompt, lora_id=lora_id, cache_salt=salt)
        h.run_to_completion()
    kv = h.sched.kv
    before = kv.cache.num_cached_blocks
    # 9 prompt and 4 output tokens: 3 full blocks under each of adapter 1's two namespaces
    assert kv.purge_lora(1) == 6
    assert kv.cache.num_cached_blocks == before - 6
    for lora_id, salt, cached in ((1, "t", 0), (2, "t", 8), (0, "t", 8)):
        r = h.add(prompt, lora_id=lora_id, cache_salt=salt)
        h.run_to_completion()
        assert r.num_cached_tokens == cached, (lora_id, salt)
    h.assert_pool_whole()


def test_a_salted_requests_blocks_have_names_of_their_own_for_the_kv_tiers():
    h = Harness(block_size=4)
    hasher = BlockHasher(model_seed("m"), 4)
    a, b, plain = (h.add(list(range(500, 509)), cache_salt=s) for s in ("a", "b", None))
    ha, hb, hp = (hasher.hashes(r, 2) for r in (a, b, plain))
    assert len({ha[0], hb[0], hp[0]}) == 3 and len({ha[1], hb[1], hp[1]}) == 3
    again = h.add(list(range(500, 509)), cache_salt="a")
    assert hasher.hashes(again, 2) == ha  # the same salt: the same names in every instance
