"""Rollout logprobs a trainer can trust: for sampled (temperature 1) rollouts, the logprob
tandem returns for each sampled token equals the trainer's recomputation with HF transformers
on the same weights and tokens, within 1e-4 in float32 (RL's importance ratios are exp of
their differences: 1e-4 is a ratio within 1.0001), whatever the batch; and after a weight
update, the recomputation under the new weights."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.conftest import build_checkpoint

PROMPTS = [[5, 17, 99, 230, 41, 8, 77], [61, 62, 63, 64], [300, 12, 90, 7, 1, 2, 3, 4, 5, 6, 7]]


def trainer_logprobs(hf, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's side: one forward pass over prompt + tokens, each token's logprob."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def rollout(llm: LLM, prompts, n: int = 4, seed: int = 0):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, n=n, seed=seed)  # fmt: skip
    for out, prompt in zip(llm.generate([list(p) for p in prompts], params, use_tqdm=False), prompts):  # fmt: skip
        for c in out.outputs:
            yield prompt, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def worst(hf, rollouts) -> float:
    diff = 0.0
    for prompt, tokens, ours in rollouts:
        theirs = trainer_logprobs(hf, prompt, tokens)
        diff = max(diff, max(abs(a - b) for a, b in zip(ours, theirs)))
    return diff


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampled_rollouts_logprobs_match_the_trainers_recomputation(checkpoints, hf_models, arch):
    llm = LLM(str(checkpoints[arch]), dtype="float32", kv_cache_memory=0.02)
    samples = list(rollout(llm, PROMPTS))
    assert len({tuple(t) for _, t, _ in samples}) > 3  # sampled: the answers differ
    assert worst(hf_models(arch), samples) <= 1e-4


def test_after_an_update_the_logprobs_are_the_new_weights(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    other = build_checkpoint(tmp_path / "b", "llama", seed=3)
    llm = LLM(str(checkpoints["llama"]), dtype="float32", kv_cache_memory=0.02)
    list(rollout(llm, PROMPTS))  # KV of the old weights cached
    llm.update_weights(model_path=str(other))
    hf = AutoModelForCausalLM.from_pretrained(str(other), dtype=torch.float32).eval()
    assert worst(hf, list(rollout(llm, PROMPTS, seed=1))) <= 1e-4
