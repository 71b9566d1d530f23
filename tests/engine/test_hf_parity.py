"""Greedy output equals HF transformers generate() token for token; logprobs agree to 1e-3."""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tests.conftest import hf_greedy

MAX_NEW = 24


def prompts_of_lengths(lengths, vocab=390, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def assert_matches_hf(llm, hf_model, prompts, max_new=MAX_NEW, check_logprobs=False):
    params = SamplingParams(
        temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=0 if check_logprobs else None
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lps = hf_greedy(hf_model, prompt, max_new)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        if check_logprobs:
            ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
            assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-3


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_batch_of_mixed_lengths_matches_hf(checkpoints, hf_models, arch, block_size):
    llm = LLM(str(checkpoints[arch]), dtype="float32", block_size=block_size, kv_cache_memory=0.01)
    assert_matches_hf(
        llm, hf_models(arch), prompts_of_lengths([3, 17, 40, 64, 9]), check_logprobs=True
    )
    llm.engine.scheduler.check_invariants()
    assert llm.engine.scheduler.kv.usage == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill_of_8_tokens_matches_hf(checkpoints, hf_models, arch):
    llm = LLM(
        str(checkpoints[arch]),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=8,
        kv_cache_memory=0.01,
    )
    assert_matches_hf(llm, hf_models(arch), prompts_of_lengths([30, 5, 21]))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_preemption_under_a_tiny_pool_matches_hf(checkpoints, hf_models, arch):
    # 6 requests needing ~56 tokens each against a pool of 96 token slots: most must wait or
    # be preempted and recomputed.
    llm = LLM(
        str(checkpoints[arch]),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        enable_prefix_caching=False,
    )
    assert_matches_hf(
        llm, hf_models(arch), prompts_of_lengths([30, 25, 20, 33, 28, 31], seed=3), max_new=MAX_NEW
    )
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.scheduler.check_invariants()
