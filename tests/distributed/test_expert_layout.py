"""Where experts go under expert parallelism, and which splits a mixture of experts refuses,
in plain Python: each expert on exactly one rank, each rank's slice of each expert tensor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.core.model_config import MoEConfig
from tandem.distributed.experts import expert_owners, held_by
from tandem.distributed.layout import ParallelLayout, check_splits, rank_config
from tandem.distributed.sharding import RankShard
from tests.distributed.test_layout import TINY

MOE = dataclasses.replace(
    TINY, architecture="MixtralForCausalLM",
    moe=MoEConfig(num_experts=6, top_k=2, intermediate_size=32, renormalize=True),
)  # fmt: skip


def test_linear_placement_gives_each_rank_a_contiguous_range_the_first_ones_more():
    assert expert_owners(6, 2, "linear") == [0, 0, 0, 1, 1, 1]
    assert expert_owners(7, 3, "linear") == [0, 0, 0, 1, 1, 2, 2]
    assert held_by(7, 3, "linear", 0) == (0, 1, 2)


def test_round_robin_placement_deals_the_experts_out():
    assert expert_owners(7, 3, "round_robin") == [0, 1, 2, 0, 1, 2, 0]
    assert held_by(7, 3, "round_robin", 1) == (1, 4)


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_every_expert_is_held_by_exactly_one_rank(strategy):
    for n, ranks in [(8, 2), (64, 4), (5, 4), (128, 3)]:
        held = [e for r in range(ranks) for e in held_by(n, ranks, strategy, r)]
        assert sorted(held) == list(range(n))


def test_expert_parallel_ranks_hold_whole_experts_and_tensor_parallel_ranks_their_columns():
    ep = RankShard(MOE, ParallelLayout(tp=2, ep=True, expert_placement="round_robin"), rank=1)
    assert ep.held == (1, 3, 5)
    assert ep.local_name("model.layers.0.mlp.experts.3.gate_proj.weight") == "model.layers.0.mlp.experts.1.gate_proj.weight"  # fmt: skip
    assert ep.local_name("model.layers.0.mlp.experts.2.gate_proj.weight") is None
    gate = torch.randn(32, 64)
    assert ep("model.layers.0.mlp.experts.3.gate_proj.weight", gate) is gate  # whole
    local = ep.model_config().moe
    assert (local.held, local.intermediate_size, local.num_experts) == ((1, 3, 5), 32, 6)
    tp = RankShard(MOE, ParallelLayout(tp=2), rank=1)
    assert tp.held is None
    assert torch.equal(tp("model.layers.0.block_sparse_moe.experts.3.w1.weight", gate), gate[16:])
    down = torch.randn(64, 32)
    assert torch.equal(tp("model.layers.0.block_sparse_moe.experts.3.w2.weight", down), down[:, 16:])  # fmt: skip
    assert tp.model_config().moe.intermediate_size == 16


def test_stacked_checkpoint_experts_split_gate_and_up_each():
    stacked = torch.arange(6 * 64 * 4.0).view(6, 64, 4)  # [E, 2I, H]: gate rows 0-31, up 32-63
    part = RankShard(MOE, ParallelLayout(tp=2), rank=1)("model.layers.0.block_sparse_moe.input_linear.weight", stacked)  # fmt: skip
    assert torch.equal(part, torch.cat([stacked[:, 16:32], stacked[:, 48:64]], 1))
    ep = RankShard(MOE, ParallelLayout(tp=2, ep=True), rank=1)
    assert torch.equal(ep("model.layers.0.block_sparse_moe.input_linear.weight", stacked), stacked[3:])  # fmt: skip


def test_splits_a_mixture_of_experts_refuses_name_why():
    with pytest.raises(ValueError, match="no experts"):
        check_splits(TINY, ParallelLayout(tp=2, ep=True))
    with pytest.raises(
        ValueError, match=r"6 experts \(one at least per rank\).*sizes that would: 1, 2, 4"
    ):
        check_splits(MOE, ParallelLayout(tp=8, ep=True))
    odd = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, intermediate_size=30))
    with pytest.raises(ValueError, match="30 columns per expert"):
        check_splits(odd, ParallelLayout(tp=4))
    check_splits(odd, ParallelLayout(tp=4, ep=True))  # whole experts: their columns stay
    olmoe = dataclasses.replace(MOE, qk_norm="full")
    with pytest.raises(ValueError, match="over the whole projection"):
        check_splits(olmoe, ParallelLayout(tp=2))


def test_a_rank_config_keeps_the_router_whole():
    local = rank_config(MOE, 2, held=(0, 1, 2))
    assert local.moe.num_experts == 6 and local.moe.held_experts() == (0, 1, 2)
    assert MOE.moe.held_experts() == tuple(range(6))
