"""A mixture of experts split over two ranks computes what one rank computes (fp32: greedy
identical, logprobs within 1e-4): experts split by columns (tensor parallel) and spread whole
(expert parallel, tokens sent to their experts by all-to-all, both placements); served, with
the per-expert token counts in /metrics. Real rank processes on loopback, gloo between them."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MOE_CONFIGS
from tests.distributed.test_parallel_parity import PROMPTS, assert_same, generate
from tests.server.conftest import Server, metrics

pytestmark = pytest.mark.slow


def test_mixtral_split_by_columns_or_spread_by_expert_matches_one_rank(moe_checkpoints):
    path = moe_checkpoints["mixtral"]
    whole, _ = generate(path, prompts=PROMPTS[:24], max_tokens=24)
    split, _ = generate(path, prompts=PROMPTS[:24], max_tokens=24, tensor_parallel_size=2)
    assert_same(split, whole, 1e-4)
    for placement in ("linear", "round_robin"):
        spread, _ = generate(path, prompts=PROMPTS[:24], max_tokens=24, tensor_parallel_size=2,
                             enable_expert_parallel=True, expert_placement_strategy=placement)  # fmt: skip
        assert_same(spread, whole, 1e-4)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "granitemoe"])
def test_expert_parallel_matches_one_rank(moe_checkpoints, arch):
    # Qwen2-MoE: a shared expert (split by columns) and a dense layer; Qwen3: q/k norms;
    # Granite: experts stacked in the checkpoint, and its scalings
    path = moe_checkpoints[arch]
    whole, _ = generate(path, prompts=PROMPTS[:16], max_tokens=16)
    spread, _ = generate(path, prompts=PROMPTS[:16], max_tokens=16, tensor_parallel_size=2,
                         enable_expert_parallel=True)  # fmt: skip
    assert_same(spread, whole, 1e-4)


def test_olmoes_whole_projection_norms_refuse_a_split(moe_checkpoints):
    with pytest.raises(ValueError, match="normalizes q and k over the whole projection"):
        generate(moe_checkpoints["olmoe"], prompts=PROMPTS[:1], tensor_parallel_size=2)


def test_served_expert_parallel_counts_the_tokens_routed_to_each_expert(moe_checkpoints, tmp_path):
    path = moe_checkpoints["mixtral"]
    (want,), _ = generate(path, prompts=[PROMPTS[20]], max_tokens=12)
    server = Server(path, ["-tp", "2", "--enable-expert-parallel",
                           "--no-enable-prefix-caching"], tmp_path, "ep2").wait_ready()  # fmt: skip
    try:
        body = {"prompt": PROMPTS[20], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        per_expert = metrics(server.url, "expert")
        counts = [per_expert.get(f"tandem:moe_expert_tokens_total:{e}", 0) for e in range(8)]
        layers, top_k = MOE_CONFIGS["mixtral"]["num_hidden_layers"], 2
        assert sum(counts) == layers * top_k * (len(PROMPTS[20]) + 12 - 1)
        assert sum(1 for c in counts if c) > 1
    finally:
        server.stop()
