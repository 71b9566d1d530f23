"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE), random-init tiny
configs from transformers' own classes: greedy output equals HF generate() token for token
in fp32, and the top logprobs agree to 1e-4; with chunked prefill, LoRA on the attention
projections (HF + peft the reference), int8 attention, and the per-expert token count."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.lora.request import LoRARequest
from tests.conftest import MOE_CONFIGS, hf_greedy
from tests.engine.test_hf_parity import prompts_of_lengths

MAX_NEW = 16


def assert_matches_hf(llm, hf_model, prompts, max_new=MAX_NEW, lora=None):
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    for prompt, out in zip(prompts, outs):
        want, want_lps = hf_greedy(hf_model, prompt, max_new)
        got = out.outputs[0]
        assert got.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_greedy_batch_of_mixed_lengths_matches_hf(moe_checkpoints, hf_models, arch):
    llm = LLM(str(moe_checkpoints[arch]), dtype="float32", block_size=4, kv_cache_memory=0.01)
    hf = hf_models(arch, moe_checkpoints[arch])
    assert_matches_hf(llm, hf, prompts_of_lengths([3, 17, 40, 9]))
    llm.engine.scheduler.check_invariants()
    assert llm.engine.scheduler.kv.usage == 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_chunked_prefill_of_8_tokens_matches_hf(moe_checkpoints, hf_models, arch):
    llm = LLM(str(moe_checkpoints[arch]), dtype="float32", block_size=4,
              max_num_batched_tokens=8, kv_cache_memory=0.01)  # fmt: skip
    assert_matches_hf(llm, hf_models(arch, moe_checkpoints[arch]), prompts_of_lengths([30, 5, 21]))  # fmt: skip


def test_experts_count_every_token_routed_through_every_moe_layer(moe_checkpoints):
    # Qwen2-MoE's layer 1 is dense: one MoE layer, 2 experts per token
    llm = LLM(str(moe_checkpoints["qwen2_moe"]), dtype="float32", kv_cache_memory=0.01,
              enable_prefix_caching=False)  # fmt: skip
    assert llm.engine.runner.expert_load() == [0] * 8
    prompts = prompts_of_lengths([11, 30])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    load = llm.engine.runner.expert_load()
    forwarded = sum(len(p) + 5 - 1 for p in prompts)  # the last token is sampled, not fed
    assert sum(load) == 2 * forwarded
    assert sum(1 for n in load if n) > 1  # a random router spreads them


def test_lora_on_attention_projections_matches_peft(moe_checkpoints, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.lora.conftest import build_adapter

    base = moe_checkpoints["mixtral"]
    adapter = build_adapter(base, tmp_path / "attn", seed=2, rank=4,
                            targets=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    ref = PeftModel.from_pretrained(hf, str(adapter)).eval()
    ref.generation_config.eos_token_id = None
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=0.01)  # fmt: skip
    prompts = prompts_of_lengths([7, 19])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("attn", 1, str(adapter)))  # fmt: skip
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, MAX_NEW)[0]


def test_an_adapter_for_an_moe_layers_mlp_is_refused_naming_the_layer(moe_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.lora.conftest import build_adapter

    base = moe_checkpoints["qwen2_moe"]  # layer 0 MoE (and a shared expert), layer 1 dense
    adapter = build_adapter(base, tmp_path / "mlp", seed=3, targets=["down_proj"])
    llm = LLM(str(base), dtype="float32", enable_lora=True, kv_cache_memory=0.01)
    # peft adapts the shared expert (and, from peft 0.22, the routed experts' fused
    # down_proj parameter): whichever weight comes first is refused, naming layer 0's MLP
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.(shared_expert\.down_proj|experts)\S* targets no projection"):  # fmt: skip
        llm.engine.runner.read_lora(str(adapter))
    file = adapter / "adapter_model.safetensors"
    dense = {k: v for k, v in load_file(str(file)).items() if "layers.1.mlp.down_proj" in k}
    save_file(dense, str(file))
    llm.engine.runner.read_lora(str(adapter))  # the dense layer's MLP adapts
    save_file({k.replace("layers.1.", "layers.0."): v for k, v in dense.items()}, str(file))
    with pytest.raises(ValueError, match="layer 0's MLP, a mixture of experts"):
        llm.engine.runner.read_lora(str(adapter))


def test_int8_attention_keeps_float_experts_close_to_the_float_model(moe_checkpoints):
    # int8 per-channel q/k/v/o (the experts stay float): each prompt's first token's logprob
    # within 0.05 nats of the float model's on the same weights, the chosen token the same
    # where float's top two are 0.1 apart
    path = str(moe_checkpoints["mixtral"])
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2)
    prompts = prompts_of_lengths([5, 12, 23, 31, 8, 17])
    floats = LLM(path, dtype="float32", kv_cache_memory=0.01).generate(prompts, params, use_tqdm=False)  # fmt: skip
    llm = LLM(path, dtype="float32", quantization="int8", kv_cache_memory=0.01)
    assert "int8" in llm.quantization and "experts float" in llm.quantization
    for f, q in zip(floats, llm.generate(prompts, params, use_tqdm=False)):
        want, got = f.outputs[0], q.outputs[0]
        top = sorted((lp.logprob for lp in want.logprobs[0].values()), reverse=True)
        if top[0] - top[1] > 0.1:
            assert got.token_ids == want.token_ids
        t = want.token_ids[0]
        assert abs(q.outputs[0].logprobs[0].get(t, want.logprobs[0][t]).logprob - want.logprobs[0][t].logprob) < 0.05  # fmt: skip
