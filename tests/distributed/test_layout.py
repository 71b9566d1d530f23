"""How a model is split over ranks, in plain Python: which sizes split it (and the message
naming the ones that would), each stage's layers, each rank's KV heads, its slice of each
checkpoint tensor, its CPUs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tandem.core.model_config import ModelConfig
from tandem.distributed.layout import ParallelLayout, check_splits, kv_heads_of, rank_config
from tandem.distributed.placement import cpu_binds
from tandem.distributed.sharding import RankShard, VocabParallelEmbedding
from tandem.engine.config import EngineConfig

SMOLLM2 = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True, qkv_bias=False,
)  # fmt: skip
TINY = dataclasses.replace(
    SMOLLM2, vocab_size=401, hidden_size=64, intermediate_size=128, num_layers=3,
    num_heads=8, num_kv_heads=2, head_dim=8,
)  # fmt: skip


def test_the_default_models_nine_heads_refuse_two_ranks_and_name_the_sizes_that_split():
    with pytest.raises(ValueError) as e:
        check_splits(SMOLLM2, ParallelLayout(tp=2))
    assert "9 attention heads, 3 KV heads" in str(e.value)
    assert str(e.value).endswith("sizes that would: 1, 3")  # 9 heads / 9 splits 3 KV heads no way
    check_splits(SMOLLM2, ParallelLayout(tp=3))


def test_kv_heads_fewer_than_the_ranks_are_replicated_each_to_the_ranks_of_its_query_heads():
    check_splits(TINY, ParallelLayout(tp=4))
    assert [kv_heads_of(TINY, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]  # fmt: skip
    assert [kv_heads_of(TINY, 2, r) for r in range(2)] == [range(0, 1), range(1, 2)]
    local = rank_config(TINY, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    assert local.vocab_size == 101  # 401 rows over 4 ranks, the last padded


def test_pipeline_stages_take_consecutive_layers_the_first_ones_one_more():
    layout = ParallelLayout(tp=1, pp=2)
    assert [layout.stage_layers(s, 3) for s in (0, 1)] == [range(0, 2), range(2, 3)]
    assert ParallelLayout(pp=3).stage_layers(2, 30) == range(20, 30)
    with pytest.raises(ValueError, match="more than the model's 3 layers"):
        check_splits(TINY, ParallelLayout(pp=4))


def test_a_rank_reads_its_rows_of_column_parallel_and_its_columns_of_row_parallel_weights():
    layout = ParallelLayout(tp=2, pp=2)
    shard = RankShard(TINY, layout, rank=3)  # stage 1 (layer 2), tensor-parallel rank 1
    assert shard.local_name("model.layers.0.mlp.up_proj.weight") is None  # stage 0's
    assert shard.local_name("model.layers.2.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"  # fmt: skip
    q = torch.arange(64 * 64.0).view(64, 64)
    assert torch.equal(shard("model.layers.2.self_attn.q_proj.weight", q), q[32:])
    assert torch.equal(shard("model.layers.2.self_attn.o_proj.weight", q), q[:, 32:])
    k = torch.arange(16 * 64.0).view(16, 64)  # 2 KV heads of 8 rows
    assert torch.equal(shard("model.layers.2.self_attn.k_proj.weight", k), k[8:])
    emb = torch.arange(401 * 2.0).view(401, 2)
    rows = shard("model.embed_tokens.weight", emb)
    assert rows.shape == (201, 2) and torch.equal(rows[:200], emb[201:]) and not rows[200].any()
    norm = torch.ones(64)
    assert shard("model.layers.2.input_layernorm.weight", norm) is norm


def test_vocab_parallel_embeddings_summed_over_ranks_give_every_token_its_row():
    table = torch.randn(401, 4)
    parts = [RankShard(TINY, ParallelLayout(tp=2), r).vocab_slice(table) for r in (0, 1)]
    ids = torch.tensor([0, 200, 201, 400, 7])
    outs = [
        VocabParallelEmbedding(torch.nn.Embedding.from_pretrained(p), r * 201, 201, lambda x: x)(
            ids
        )  # fmt: skip
        for r, p in enumerate(parts)
    ]
    assert torch.equal(outs[0] + outs[1], table[ids])


def test_cpu_binding_splits_this_process_cpus_or_takes_vllms_list():
    assert cpu_binds("0-1|2-3", [0, 1]) == {0: [0, 1], 1: [2, 3]}
    assert cpu_binds("none", [0, 1]) == {}
    cpus, binds = sorted(os.sched_getaffinity(0)), cpu_binds("auto", [0, 1])
    if len(cpus) >= 2:  # each rank its own half, in order
        assert binds[0] + binds[1] == cpus[: len(cpus) // 2 * 2] and binds[0] != binds[1]
    with pytest.raises(ValueError, match="names 1 ranks' CPUs; this node runs 2"):
        cpu_binds("0-3", [0, 1])
    with pytest.raises(ValueError, match="not a CPU list"):
        cpu_binds("a-b|1", [0, 1])


def test_auto_binding_keeps_each_rank_on_one_numa_node(tmp_path, monkeypatch):
    # two sockets whose CPUs interleave (0,2,4,6 | 1,3,5,7), as many servers number them
    for node, cpus in (("node0", "0,2,4,6"), ("node1", "1,3,5,7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_binds("auto", [0, 1], tmp_path) == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
    assert cpu_binds("auto", [0, 1, 2, 3], tmp_path) == {0: [0, 2], 1: [4, 6], 2: [1, 3], 3: [5, 7]}  # fmt: skip
    # 3 ranks on 2 nodes: node by node, 2 CPUs each, none straddling
    assert cpu_binds("auto", [0, 1, 2], tmp_path) == {0: [0, 2], 1: [4, 6], 2: [1, 3]}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 4, 6})  # a cpuset of one node
    assert cpu_binds("auto", [0, 1], tmp_path) == {0: [0, 2], 1: [4, 6]}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(tensor_parallel_size=2, nnodes=3), "nnodes"),
        (dict(node_rank=1), "node_rank"),
        (dict(tensor_parallel_size=2, nnodes=2, headless=True), "headless"),
        (dict(tensor_parallel_size=2, enable_lora=True), "enable_lora"),
        (dict(tensor_parallel_size=2, device="cuda"), "device"),
        (dict(tensor_parallel_size=2, distributed_timeout=0), "distributed_timeout"),
        (dict(distributed_executor_backend="mpi"), "distributed_executor_backend"),
    ],
)
def test_bad_parallel_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**kwargs)
