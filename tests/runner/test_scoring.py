"""Scoring a text through the paged cache (runner/scoring.py): each token's logprob is the one
the engine gives that token when it samples it, whatever the chunking, and the blocks it
borrows come back."""

from __future__ import annotations

import math

import pytest

from tandem import LLM, SamplingParams
from tandem.runner.scoring import perplexity, token_logprobs


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints["llama"]), dtype="float32", kv_cache_memory=0.01, block_size=8)


def test_a_tokens_logprob_is_the_one_the_engine_samples_it_with(llm):
    prompt = [7, 42, 99, 5, 310, 12, 8, 77, 150, 3, 61]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    text = prompt + list(out.token_ids)
    sampled = [next(iter(lp.values())).logprob for lp in out.logprobs]
    for chunk in (1, 4, 64):  # the decode path, short chunks across blocks, one chunk
        scored = token_logprobs(llm.engine, text, chunk)
        assert len(scored) == len(text) - 1
        assert scored[len(prompt) - 1 :] == pytest.approx(sampled, abs=1e-4)


def test_scoring_gives_back_every_block_it_borrows(llm):
    kv = llm.engine.scheduler.kv
    free = kv.num_free_blocks
    token_logprobs(llm.engine, list(range(5, 205)), 16)
    assert kv.num_free_blocks == free
    kv.check_invariants()


def test_a_text_the_cache_cannot_hold_is_refused(llm):
    kv = llm.engine.scheduler.kv
    too_long = [5] * (kv.num_usable_blocks * kv.block_size + 1)
    with pytest.raises(ValueError, match="do not fit the KV cache"):
        token_logprobs(llm.engine, too_long)
    with pytest.raises(ValueError, match="tokens: need at least 2"):
        token_logprobs(llm.engine, [5])
    with pytest.raises(ValueError, match="chunk: must be >= 1"):
        token_logprobs(llm.engine, [5, 6], chunk=0)


def test_perplexity_is_the_exponent_of_the_mean_negative_logprob():
    assert perplexity([math.log(0.5)] * 3) == pytest.approx(2.0)
    assert perplexity([math.log(0.25), math.log(1.0)]) == pytest.approx(2.0)
