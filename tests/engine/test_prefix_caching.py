"""Prefix caching end to end: outputs identical with the cache on and off, exact hit counts."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = list(range(40, 72))  # 32 tokens


def shared_prefix_prompts():
    return [SYSTEM + [5 + i, 9, 11 + i] for i in range(6)] + [SYSTEM[:13] + [7, 7], [3, 4, 5]]


def run_batches(llm, batches):
    return [
        [o.outputs[0].token_ids for o in llm.generate(b, GREEDY, use_tqdm=False)] for b in batches
    ]


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(max_num_batched_tokens=8), dict(num_kv_blocks=30)],
    ids=["default", "chunk-8", "tiny-pool-preemption"],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_outputs_are_identical_with_the_cache_on_and_off(checkpoints, arch, settings):
    batches = [
        shared_prefix_prompts(),
        shared_prefix_prompts()[::-1],
    ]  # the second run hits the cache
    results = {}
    for caching in (True, False):
        llm = LLM(
            str(checkpoints[arch]),
            dtype="float32",
            block_size=4,
            enable_prefix_caching=caching,
            kv_cache_memory=0.01,
            **settings,
        )
        results[caching] = run_batches(llm, batches)
        stats = llm.engine.stats()
        llm.engine.scheduler.check_invariants()
        if caching:
            assert stats.prefix_cache_hits > 0
        if "num_kv_blocks" in settings:
            assert stats.num_preemptions > 0
    assert results[True] == results[False]


def test_hit_counts_on_a_shared_system_prompt(llama_path):
    llm = LLM(str(llama_path), dtype="float32", block_size=4, kv_cache_memory=0.01)
    llm.generate([SYSTEM + [1, 2]], GREEDY, use_tqdm=False)
    outs = llm.generate([SYSTEM + [3, 4, 5], SYSTEM + [6]], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [32, 32]
    s = llm.engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (34 + 35 + 33, 64)


def test_hit_counts_on_a_multi_turn_chat(llama_path):
    """Each turn resends the whole history; everything but the newest turn is cached."""
    llm = LLM(str(llama_path), dtype="float32", block_size=4, kv_cache_memory=0.01)
    history = list(SYSTEM[:10])
    expected = 0
    for turn in range(4):
        out = llm.generate(
            [history], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
        )[0]
        assert out.num_cached_tokens == expected
        # prompt + the outputs fed back; the last sampled token's KV was never computed
        computed = len(history) + 4
        expected = computed // 4 * 4
        history = history + out.outputs[0].token_ids + [60 + turn, 61, 62]
    assert expected > 0


def test_a_prefix_that_ends_mid_block_hits_its_whole_blocks_only(llama_path):
    llm = LLM(str(llama_path), dtype="float32", block_size=4, kv_cache_memory=0.01)
    llm.generate([SYSTEM[:10]], GREEDY, use_tqdm=False)
    out = llm.generate([SYSTEM[:10] + [1, 1, 1, 1]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 8
