"""Sampler semantics on hand-made logits."""

from __future__ import annotations

import math

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.runner.sampler import Sampler, apply_penalties, apply_top_k_top_p, argmax

CPU = torch.device("cpu")


def sample(logits, params, token_ids=None, num_prompt=None, ids=None, sampler=None):
    n = len(params)
    sampler = sampler or Sampler(0, CPU)
    return sampler.sample(
        torch.tensor(logits, dtype=torch.float32),
        ids or [f"r{i}" for i in range(n)],
        params,
        token_ids or [[0]] * n,
        num_prompt or [1] * n,
    )


def test_greedy_takes_the_argmax_and_ignores_temperature_rows_next_to_it():
    logits = [[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]]
    out = sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0)])
    assert out.token_ids == [1, 0]


def test_top_k_1_and_tiny_top_p_are_deterministic():
    logits = [[0.0, 3.0, 1.0, 2.9]] * 2
    out = sample(
        logits,
        [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.01)],
    )
    assert out.token_ids == [1, 1]


def test_top_k_top_p_masks_as_specified():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda x: (x > float("-inf")).int().tolist()[0]  # noqa: E731
    assert kept(apply_top_k_top_p(logits, [2], [1.0])) == [1, 1, 0, 0]
    # top_p 0.8: 0.5 + 0.3 reaches it, so the rest goes
    assert kept(apply_top_k_top_p(logits, [0], [0.8])) == [1, 1, 0, 0]
    assert kept(apply_top_k_top_p(logits, [0], [0.81])) == [1, 1, 1, 0]
    assert kept(apply_top_k_top_p(logits, [0], [1.0])) == [1, 1, 1, 1]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    draws = {
        sample(logits.tolist(), [SamplingParams(min_p=0.4, seed=s)]).token_ids[0] for s in range(60)
    }
    assert draws == {0, 1}  # 0.1 < 0.4 * 0.6


def test_sampling_follows_the_distribution():
    sampler = Sampler(1, CPU)
    probs = [0.7, 0.2, 0.1]
    logits = [[math.log(p) for p in probs]] * 4000
    out = sample(logits, [SamplingParams(temperature=1.0)] * 4000, sampler=sampler)
    freq = [out.token_ids.count(i) / 4000 for i in range(3)]
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, probs))


def test_a_seeded_request_draws_the_same_tokens_whatever_the_batch():
    logits = [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(0, CPU)
    crowd = Sampler(99, CPU)
    a = [sample(logits, [seeded], ids=["x"], sampler=alone).token_ids[0] for _ in range(20)]
    b = [
        sample(
            logits * 3,
            [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5)],
            ids=["o1", "x", "o2"],
            sampler=crowd,
        ).token_ids[1]
        for _ in range(20)
    ]
    assert a == b and len(set(a)) > 1


def test_penalties_follow_vllm_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    # prompt [0], output [1, 1]; token 3 unseen
    rep = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1, 1]], [1])
    assert rep.tolist() == [[1.0, -4.0, 1.0, 1.0]]
    pres = apply_penalties(logits, [SamplingParams(presence_penalty=0.5)], [[0, 1, 1]], [1])
    assert pres.tolist() == [[2.0, -2.5, 1.0, 1.0]]  # output tokens only
    freq = apply_penalties(logits, [SamplingParams(frequency_penalty=0.5)], [[0, 1, 1]], [1])
    assert freq.tolist() == [[2.0, -3.0, 1.0, 1.0]]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], eos_token_ids=(0,))
    logits = [[9.0, 8.0, 1.0]]
    assert sample(logits, [params], token_ids=[[5, 6]], num_prompt=[1]).token_ids == [
        2
    ]  # 1 output so far
    assert sample(logits, [params], token_ids=[[5, 6, 7]], num_prompt=[1]).token_ids == [0]


def test_logprobs_report_the_sampled_token_its_rank_and_the_top_k():
    logits = [[1.0, 3.0, 2.0]]
    out = sample(logits, [SamplingParams(temperature=0, logprobs=2)])
    ids, lps, rank = out.logprobs[0]
    expected = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert ids == [1, 1, 2] and rank == 1
    assert lps == [expected[1].item(), expected[1].item(), expected[2].item()]
    none = sample(logits, [SamplingParams(temperature=0)])
    assert none.logprobs == [None]


def test_argmax_picks_what_torch_argmax_picks_among_ties_and_nans():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        ties = torch.randint(0, 4, (16, 4096), generator=g).to(dtype)  # many tied maxima
        ties[3, 100], ties[5, 7] = float("nan"), float("inf")
        spread = torch.randn(16, 4096, generator=g).to(dtype)
        for x in (ties, spread):
            assert torch.equal(argmax(x), x.argmax(dim=-1))
