"""A model split over ranks computes what the whole model computes: greedy tokens identical
and logprobs within 1e-4 (fp32), for tensor parallelism, pipeline parallelism and both, for
Llama, Qwen2 and Mistral with 8 heads and 2 KV heads; with KV heads replicated where the
ranks outnumber them; and quantized (int4 groups split whole). Real rank processes on
loopback, gloo between them, one CPU each."""

from __future__ import annotations

import pytest

from tandem.core.sampling_params import SamplingParams
from tandem.engine.llm import LLM
from tests.conftest import build_checkpoint

pytestmark = pytest.mark.slow

EIGHT_HEADS = dict(num_attention_heads=8, num_key_value_heads=2)
PROMPTS = [[5 + (i * 37 + j * 11) % 390 for j in range(3 + i % 29)] for i in range(64)]


@pytest.fixture(scope="module")
def eight_head_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        arch: build_checkpoint(root / arch, arch, num_hidden_layers=3, **EIGHT_HEADS)
        for arch in ("llama", "qwen2", "mistral")
    }


def generate(path, prompts=PROMPTS, max_tokens=64, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    with LLM(str(path), dtype="float32", num_kv_blocks=512, **kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        ranks = llm.engine.runner.distributed
        used = (ranks.ranks.num_shm, ranks.ranks.num_gloo) if ranks is not None else None
    return [o.outputs[0] for o in outputs], used


def assert_same(split, whole, tolerance):
    for a, b in zip(split, whole):
        assert a.token_ids == b.token_ids
        for got, want in zip(a.logprobs, b.logprobs):
            assert got.keys() == want.keys()
            for token, lp in want.items():
                assert abs(got[token].logprob - lp.logprob) < tolerance


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_two_tensor_parallel_ranks_match_one(eight_head_checkpoints, arch):
    path = eight_head_checkpoints[arch]
    whole, _ = generate(path)
    split, (shm, gloo) = generate(path, tensor_parallel_size=2)
    assert_same(split, whole, 1e-4)
    assert shm > 0  # the ranks share a host: their small sums went through shared memory


def test_pipeline_stages_and_both_kinds_together_match_one_rank(eight_head_checkpoints):
    path = eight_head_checkpoints["llama"]
    whole, _ = generate(path)
    assert_same(generate(path, pipeline_parallel_size=2)[0], whole, 1e-4)  # layers 0-1 | 2
    assert_same(generate(path, tensor_parallel_size=2, pipeline_parallel_size=2)[0], whole, 1e-4)


def test_kv_heads_replicated_over_more_ranks_than_heads_match_one_rank(eight_head_checkpoints):
    path = eight_head_checkpoints["qwen2"]  # 2 KV heads, 4 ranks: each held twice
    whole, _ = generate(path, prompts=PROMPTS[:16], max_tokens=16)
    split, _ = generate(path, prompts=PROMPTS[:16], max_tokens=16, tensor_parallel_size=4)
    assert_same(split, whole, 1e-4)


def test_int4_shares_quantize_by_the_same_groups_as_the_whole_model(eight_head_checkpoints):
    # o_proj's 64 and down_proj's 128 input columns split in two: 32 and 64, whole groups of
    # 32, so the ranks hold exactly the whole model's blocks. The int4 kernels take bf16
    # activations and the head gives bf16 logits (steps of 1/64 at this size), so partial sums
    # added in another order move a logprob by a few such steps: 0.05 nats. This random
    # model's next-token distribution is flat enough for such steps to reorder near-ties, so
    # each prompt's first token is compared (where the whole model's top two are apart).
    path = eight_head_checkpoints["llama"]
    kw = dict(max_tokens=1, quantization="int4")
    whole, _ = generate(path, **kw)
    split, (shm, _) = generate(path, tensor_parallel_size=2, **kw)
    decided = 0
    for a, b in zip(split, whole):
        (got,), (want,) = a.logprobs, b.logprobs
        top = sorted((lp.logprob for lp in want.values()), reverse=True)
        if top[0] - top[1] > 0.1:
            assert a.token_ids == b.token_ids
            decided += 1
        for token in want.keys() & got.keys():
            assert abs(got[token].logprob - want[token].logprob) < 0.05
    assert decided >= 16 and shm > 0


@pytest.mark.default_model
def test_the_default_models_gguf_blocks_split_over_ranks_follow_one_rank():
    # 9 heads and 3 KV heads split over 3 ranks; each rank cuts the file's own Q4_1 and Q8_0
    # blocks (rows, or whole 32-column blocks), so every weight is the one-rank model's
    messages = [[{"role": "user", "content": q}] for q in (
        "What is the capital of France? Tell me about it.", "Name three prime numbers.")]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    replies = {}
    for split in (dict(), dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2)):
        with LLM(None, kv_cache_memory=0.05, max_model_len=512, **split) as llm:
            layers = 30 // split.get("pipeline_parallel_size", 1)  # rank 0's stage
            assert llm.quantization.startswith(f"GGUF blocks: projections {4 * layers} Q4_1")
            replies[tuple(split.items())] = [
                llm.chat(m, params, use_tqdm=False)[0].outputs[0].token_ids for m in messages
            ]
    whole, *splits = replies.values()
    assert all(s == whole for s in splits)
    assert len(set(whole[0])) > 8  # a reply, not one token repeated
