"""Speculative decoding end to end on the tiny checkpoints: greedy output with either
proposer equals HF transformers token for token; sampled output has the same distribution as
without speculation (and, seeded, the very same tokens); penalties, stop conditions and
logprobs behave as without it; nothing leaks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.runner import model_runner
from tests.conftest import build_checkpoint
from tests.engine.test_hf_parity import assert_matches_hf, prompts_of_lengths

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def repetitive_prompts(seed=0):
    """Mixed lengths, some repeating a phrase, so n-gram lookup has something to find."""
    rng = random.Random(seed)
    phrase = [rng.randrange(5, 390) for _ in range(7)]
    return [*prompts_of_lengths([3, 17, 40], seed=seed), phrase * 4, phrase * 2 + [9, 8, 7]]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A checkpoint of the same shape and tokenizer with other weights: its guesses miss."""
    return build_checkpoint(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=1)


def spec_llm(path, spec, **kw):
    kw.setdefault("kv_cache_memory", 0.01)
    return LLM(str(path), dtype="float32", speculative_config=spec, **kw)


def assert_nothing_held(llm):
    llm.engine.step()  # delivers the last finished ids to the runner and its proposer
    llm.engine.scheduler.check_invariants()
    assert llm.engine.scheduler.kv.usage == 0
    proposer = llm.engine.runner.proposer
    if hasattr(proposer, "kv"):
        proposer.check_invariants()
        assert proposer.kv.usage == 0 and not proposer._shadows


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_ngram_greedy_matches_hf(checkpoints, hf_models, arch, block_size):
    llm = spec_llm(checkpoints[arch], NGRAM, block_size=block_size)
    assert_matches_hf(llm, hf_models(arch), repetitive_prompts(), max_new=32, check_logprobs=True)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0  # speculation took part
    assert_nothing_held(llm)


def test_ngram_greedy_matches_hf_under_preemption(checkpoints, hf_models):
    llm = spec_llm(
        checkpoints["llama"], NGRAM, block_size=4, num_kv_blocks=30, kv_cache_memory=None
    )
    prompts = repetitive_prompts(seed=3) + prompts_of_lengths([30, 25], seed=4)
    assert_matches_hf(llm, hf_models("llama"), prompts, max_new=32)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_nothing_held(llm)


@pytest.mark.parametrize("draft", ["same", "other"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_draft_model_greedy_matches_hf(checkpoints, hf_models, other_draft, draft, block_size):
    path = checkpoints["llama"] if draft == "same" else other_draft
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = spec_llm(checkpoints["llama"], spec, block_size=block_size)
    assert_matches_hf(llm, hf_models("llama"), repetitive_prompts(), max_new=24)
    stats = llm.engine.scheduler.spec_stats
    if draft == "same":  # the target drafting for itself: every greedy guess is right
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.acceptance_rate < 0.2
    assert_nothing_held(llm)


def test_draft_model_with_a_tiny_pool_of_its_own_still_matches(checkpoints, hf_models):
    # 12 draft blocks of 4 tokens cannot hold every request's context: rows that find no
    # room guess nothing that step, and the output is unchanged.
    spec = {
        "method": "draft_model",
        "model": str(checkpoints["llama"]),
        "num_speculative_tokens": 3,
        "num_draft_kv_blocks": 12,
    }
    llm = spec_llm(checkpoints["llama"], spec, block_size=4)
    assert_matches_hf(llm, hf_models("llama"), repetitive_prompts(seed=5), max_new=24)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_nothing_held(llm)


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_penalties_min_tokens_logprobs_and_stop_tokens_behave_as_without_speculation(
    checkpoints, spec
):
    config = NGRAM if spec == "ngram" else {
        "method": "draft_model", "model": str(checkpoints["llama"]), "num_speculative_tokens": 4
    }  # fmt: skip
    plain = LLM(str(checkpoints["llama"]), dtype="float32", kv_cache_memory=0.01)
    fast = spec_llm(checkpoints["llama"], config)
    prompts = repetitive_prompts(seed=7)
    base = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    stop_token = base[3].outputs[0].token_ids[10]  # a token the plain run emits mid-output
    cases = [
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.8, frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=7),
    ]
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        got = fast.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            a, b = w.outputs[0], g.outputs[0]
            assert (a.token_ids, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.finish_reason,
                b.stop_reason,
            )
            if params.logprobs:
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys()
                    assert max(abs(la[t].logprob - lb[t].logprob) for t in la) < 1e-4
    assert fast.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_nothing_held(fast)


def test_a_stop_string_inside_accepted_drafts_ends_the_output_where_plain_decoding_does(
    checkpoints,
):
    plain = LLM(str(checkpoints["llama"]), dtype="float32", kv_cache_memory=0.01)
    fast = spec_llm(checkpoints["llama"], NGRAM)
    prompts = repetitive_prompts(seed=7)[3:]
    params = SamplingParams(temperature=0, max_tokens=40)
    text = plain.generate(prompts, params, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    want = plain.generate(prompts, params, use_tqdm=False)
    got = fast.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].stop_reason == stop
    assert_nothing_held(fast)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(checkpoints):
    # The verifier samples each drafted position as plain decoding would, and a seeded
    # request's generator is rewound past the rows it discards: the very same tokens.
    spec = {
        "method": "draft_model",
        "model": str(checkpoints["llama"]),
        "num_speculative_tokens": 4,
    }
    plain = LLM(str(checkpoints["llama"]), dtype="float32", kv_cache_memory=0.01)
    fast = spec_llm(checkpoints["llama"], spec)
    prompts = repetitive_prompts(seed=2)
    params = [SamplingParams(temperature=0.8, top_k=4, max_tokens=30, seed=s) for s in range(5)]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = fast.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = fast.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some kept, some rejected
    assert_nothing_held(fast)


def chi_squared_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-squared test of homogeneity over the union of outcomes."""
    keys = sorted(set(a) | set(b))
    table = torch.tensor([[a[k] for k in keys], [b[k] for k in keys]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(keys) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def second_and_third_tokens(llm, prompt, n):
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, n=200, ignore_eos=True)
    outs = llm.generate([prompt] * (n // 200), params, use_tqdm=False)
    return Counter(tuple(c.token_ids[1:3]) for o in outs for c in o.outputs)


@pytest.fixture(scope="module")
def sampled_histograms(checkpoints):
    """Histograms of (2nd, 3rd) output token over 1400 unseeded samples: plain, and with the
    target drafting for itself (greedy guesses, accepted with probability p(guess))."""
    path = checkpoints["llama"]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    prompt = [11, 52, 33, 74]
    plain = LLM(str(path), dtype="float32", kv_cache_memory=0.05, seed=1)
    fast = spec_llm(path, spec, kv_cache_memory=0.05, seed=2)
    return plain, fast, prompt, second_and_third_tokens(plain, prompt, 1400)


def test_sampled_output_has_the_same_distribution_with_speculation(sampled_histograms):
    plain, fast, prompt, want = sampled_histograms
    got = second_and_third_tokens(fast, prompt, 1400)
    stats = fast.engine.scheduler.spec_stats
    assert 0.1 < stats.acceptance_rate < 0.9  # both verdicts occur often
    assert chi_squared_p_value(want, got) > 1e-3


def test_the_distribution_test_catches_a_wrong_acceptance_rule(sampled_histograms, monkeypatch):
    plain, fast, prompt, want = sampled_histograms
    # Accepting every guess (no verification) skews the output towards the greedy guesses.
    monkeypatch.setattr(model_runner, "num_agreeing", lambda targets, drafts: len(drafts))
    got = second_and_third_tokens(fast, prompt, 1400)
    assert chi_squared_p_value(want, got) < 1e-6


def test_a_draft_model_that_cannot_be_loaded_is_refused_naming_the_field(checkpoints, tmp_path):
    spec = {
        "method": "draft_model",
        "model": str(tmp_path / "nothing"),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(ValueError, match="speculative_config.model"):
        spec_llm(checkpoints["llama"], spec)
