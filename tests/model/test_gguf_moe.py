"""llama.cpp's mixtures of experts as GGUF files (Mixtral as `llama` with experts, `qwen3moe`),
written here with the gguf library from a random-init transformers model (tokenizer from the
bundled GGUF): float32 tensors give transformers' greedy output token for token; Q8_0
attention blocks run on their own kernels and follow the float path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.model.loader import default_model_path
from tests.conftest import hf_greedy

SMALL = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=32, num_experts_per_tok=2,
             rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.15)  # fmt: skip


def hf_model(arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "llama":
        cfg = AutoConfig.for_model("mixtral", **SMALL, num_local_experts=4)
    else:
        cfg = AutoConfig.for_model("qwen3_moe", **SMALL, num_experts=4, moe_intermediate_size=32,
                                   head_dim=16, norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf: Llama's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # fmt: skip


def write_gguf(model, arch: str, path, attention_type: str = "F32"):
    import gguf

    reader = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(path, arch)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    c = model.config
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_context_length(1024)
    writer.add_expert_count(c.num_local_experts if arch == "llama" else c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = permute(q, heads), permute(k, kv)
        attention = {"attn_q": q, "attn_k": k, "attn_v": sd[p + "self_attn.v_proj.weight"],
                     "attn_output": sd[p + "self_attn.o_proj.weight"]}  # fmt: skip
        for name, w in attention.items():
            if attention_type == "Q8_0":
                qtype = gguf.GGMLQuantizationType.Q8_0
                writer.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(w, qtype), raw_dtype=qtype)  # fmt: skip
            else:
                writer.add_tensor(f"blk.{i}.{name}.weight", w)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        if arch == "qwen3moe":
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        block = p + "mlp."  # transformers 5 names both blocks mlp
        gate_up = sd[block + "experts.gate_up_proj"]  # [E, 2I, H]: gate, then up
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[block + "gate.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(np.split(gate_up, 2, 1)[0]))  # fmt: skip
        writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(np.split(gate_up, 2, 1)[1]))  # fmt: skip
        writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[block + "experts.down_proj"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in (4, 19, 33)]


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_a_float_moe_gguf_gives_transformers_greedy_output(arch, tmp_path):
    model = hf_model(arch)
    path = write_gguf(model, arch, tmp_path / f"tiny-{arch}.gguf")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.05, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts(), llm.generate(prompts(), params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)[0]
    assert len(llm.engine.runner.expert_load()) == 4


def test_q8_0_attention_blocks_of_an_moe_gguf_follow_the_float_path(tmp_path):
    # Q8_0's own blocks (int8 with a scale per 32) on the int4 kernels, experts in float:
    # each prompt's first token as the dequantized float path picks it, where its top two
    # are 0.1 apart, and its logprob within 0.05
    model = hf_model("llama")
    path = write_gguf(model, "llama", tmp_path / "tiny-q8.gguf", attention_type="Q8_0")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2)
    outs = {}
    for method in ("gguf", "none"):
        llm = LLM(str(path), dtype="float32", quantization=method, kv_cache_memory=0.05, max_model_len=256)  # fmt: skip
        outs[method] = llm.generate(prompts(), params, use_tqdm=False)
        if method == "gguf":
            assert "Q8_0" in llm.quantization
    for q, f in zip(outs["gguf"], outs["none"]):
        want, got = f.outputs[0], q.outputs[0]
        top = sorted((lp.logprob for lp in want.logprobs[0].values()), reverse=True)
        if top[0] - top[1] > 0.1:
            assert got.token_ids == want.token_ids
        t = want.token_ids[0]
        assert abs(got.logprobs[0].get(t, want.logprobs[0][t]).logprob - want.logprobs[0][t].logprob) < 0.05  # fmt: skip
