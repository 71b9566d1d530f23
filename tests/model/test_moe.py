"""The mixture-of-experts layer against transformers' own routers and expert loop on the same
weights (fp32), its config reading, and the checks that refuse what it cannot run."""

from __future__ import annotations

import pytest
import torch

from tandem.core.model_config import ModelConfig
from tandem.model.layers import SiluAndMul
from tandem.model.moe import SparseMoE, fused_experts, moe_param_name, route
from tests.conftest import MOE_CONFIGS


def hf_config(arch: str, **overrides):
    from transformers import AutoConfig

    fields = {k: v for k, v in MOE_CONFIGS[arch].items() if k != "model_type"}
    return AutoConfig.for_model(MOE_CONFIGS[arch]["model_type"], **{**fields, **overrides})


def hf_module(arch: str):
    model_type = MOE_CONFIGS[arch]["model_type"]
    return __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["x"])


@pytest.mark.parametrize(
    "arch, router",
    [("mixtral", "MixtralTopKRouter"), ("qwen2_moe", "Qwen2MoeTopKRouter"),
     ("qwen3_moe", "Qwen3MoeTopKRouter"), ("olmoe", "OlmoeTopKRouter"),
     ("granitemoe", "GraniteMoeTopKRouter")],
)  # fmt: skip
def test_routing_picks_the_experts_and_weights_transformers_picks(arch, router):
    cfg = hf_config(arch)
    torch.manual_seed(0)
    hf = getattr(hf_module(arch), router)(cfg)
    torch.nn.init.normal_(hf.weight, std=0.5)
    x = torch.randn(37, cfg.hidden_size)
    _, want_w, want_ids = hf(x)
    moe = ModelConfig.from_hf(cfg.to_dict() | {"architectures": MOE_CONFIGS[arch]["architectures"]}).moe  # fmt: skip
    got_w, got_ids = route(x @ hf.weight.T, moe.top_k, moe.renormalize, moe.scoring)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(got_w, want_w, atol=1e-6)
    assert moe.renormalize == (arch in ("mixtral", "granitemoe", "qwen3_moe"))


def test_sigmoid_scores_pick_the_largest_sigmoids_and_renormalize():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    weights, ids = route(logits, 2, True, "sigmoid")
    assert ids.tolist() == [[1, 3]]
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    assert torch.allclose(weights[0], s / s.sum())


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_equal_transformers_expert_loop(tokens):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = hf_config("mixtral")
    cfg._experts_implementation = "eager"  # the loop over the experts hit
    torch.manual_seed(1)
    hf = MixtralExperts(cfg)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(tokens, cfg.hidden_size)
    ids = torch.randint(0, 3, (tokens, 2))  # experts 3-7 get no tokens
    ids[:, 1] = (ids[:, 0] + 1) % 3
    weights = torch.rand(tokens, 2)
    want = hf(x, ids, weights)
    got = fused_experts(x, weights, ids, hf.gate_up_proj.data, hf.down_proj.data, SiluAndMul())
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_experts_compute_what_the_grouped_matmul_computes(dtype):
    from tandem.model.packed_linear import packing_available

    if not packing_available(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (the runner then keeps the grouped matmul)")  # fmt: skip
    cfg = ModelConfig.from_hf({**MOE_CONFIGS["mixtral"], "vocab_size": 100})
    torch.manual_seed(2)
    moe = SparseMoE(cfg, SiluAndMul()).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(40, cfg.hidden_size, dtype=dtype)
    with torch.no_grad():
        want = moe(x)
        moe.pack_experts()
        got = moe(x)
    assert moe.w13.numel() == 0  # the stacked copy released
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert moe.routed.sum() == 2 * 2 * 40  # both calls counted, 2 experts a token


def test_no_tokens_give_no_rows():
    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    out = fused_experts(torch.empty(0, 8), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long), w13, w2, SiluAndMul())  # fmt: skip
    assert out.shape == (0, 8)


def test_config_reads_each_architectures_experts():
    base = dict(vocab_size=100, max_position_embeddings=64)
    q2 = ModelConfig.from_hf({**MOE_CONFIGS["qwen2_moe"], **base, "decoder_sparse_step": 1})
    assert (q2.moe.num_experts, q2.moe.top_k, q2.moe.intermediate_size) == (8, 2, 32)
    assert q2.moe.shared_intermediate_size == 48 and q2.moe.dense_layers == (1,)
    assert q2.is_moe_layer(0) and not q2.is_moe_layer(1) and q2.qkv_bias
    stepped = ModelConfig.from_hf({**MOE_CONFIGS["qwen2_moe"], **base, "mlp_only_layers": [], "decoder_sparse_step": 2})  # fmt: skip
    assert stepped.moe.dense_layers == (0,)  # layer i is sparse where (i + 1) % step == 0
    assert ModelConfig.from_hf({**MOE_CONFIGS["qwen3_moe"], **base}).qk_norm == "head"
    assert ModelConfig.from_hf({**MOE_CONFIGS["olmoe"], **base}).qk_norm == "full"
    granite = ModelConfig.from_hf({**MOE_CONFIGS["granitemoe"], **base})
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (6.0, 0.5)
    assert (granite.attention_multiplier, granite.logits_scaling) == (0.2, 2.0)
    dense = ModelConfig.from_hf({**MOE_CONFIGS["mixtral"], **base, "architectures": ["MistralForCausalLM"]})  # fmt: skip
    assert dense.moe is None


@pytest.mark.parametrize(
    "field, value, message",
    [("clip_qkv", 8.0, "clip_qkv"), ("scoring_func", "softplus", "scoring_func")],
)
def test_unsupported_moe_settings_are_refused_naming_the_field(field, value, message):
    cfg = {**MOE_CONFIGS["olmoe"], "vocab_size": 100, field: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(cfg)


def test_checkpoint_names_map_to_the_stacked_experts():
    assert moe_param_name("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.router.weight"  # fmt: skip
    assert moe_param_name("model.layers.0.block_sparse_moe.router.layer.weight") == "model.layers.0.mlp.router.weight"  # fmt: skip
    assert moe_param_name("model.layers.0.block_sparse_moe.input_linear.weight") == "model.layers.0.mlp.w13"  # fmt: skip
    assert moe_param_name("model.layers.1.mlp.shared_expert_gate.weight") == "model.layers.1.mlp.shared_expert_gate.weight"  # fmt: skip
    assert moe_param_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(moe_checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tandem import LLM

    folder = tmp_path / "broken"
    shutil.copytree(moe_checkpoints["mixtral"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.1.mlp.w13\[shard \(5, 1\)\]'\]"):  # fmt: skip
        LLM(str(folder), dtype="float32", kv_cache_memory=0.01)
