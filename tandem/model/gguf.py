"""GGUF files of Llama-architecture models (and llama.cpp's mixtures of experts: Mixtral as
`llama` with experts, `qwen3moe`), turned into an HF checkpoint folder once.

Dequantizing and rebuilding the tokenizer from GGUF metadata takes ~15 s for the default
model, so the result (config.json, float32 safetensors, tokenizer files) is cached under
`$TANDEM_CACHE_DIR` (default ~/.cache/tandem), keyed by a hash of the file's contents, so
copies of one file at other paths share it. The hash itself is remembered per (path, size,
mtime), so it is computed once per copy. Every later load is an ordinary safetensors load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tandem")

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's, per head
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# llama.cpp's MoE tensors: the router, and each layer's experts stacked [experts, out, in]
_EXPERT_NAMES = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
# GGUF architecture -> (its HF architecture with experts, model_type, per-expert names of
# gate, up, down, the MoE block's name, the router's)
_MOE_ARCHS = {
    "llama": ("MixtralForCausalLM", "mixtral", ("w1", "w3", "w2"), "block_sparse_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", ("gate_proj", "up_proj", "down_proj"), "mlp"),
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def gguf_as_hf_folder(path: Path) -> Path:
    """The HF-format folder for a GGUF file, converting it on first use."""
    key = content_key(path)
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    log.info("dequantizing %s to %s (once; later starts load the result)", path.name, folder)
    try:
        _convert(path, tmp)
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "config.json").exists():  # lost a race with nobody: a real error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def content_key(path: Path) -> str:
    """A hash of the file's bytes, remembered in the cache per (path, size, mtime)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    memo = cache_root() / "gguf" / "hashes" / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    if memo.exists():
        return memo.read_text()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    key = digest.hexdigest()[:16]
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(key)
    return key


def _convert(path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(path)
    # Skip the tokenizer's big arrays; the tokenizer is rebuilt by transformers below.
    small = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    meta = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not k.startswith("tokenizer.ggml.") or k in small
    }
    arch = meta.get("general.architecture")
    if arch not in _MOE_ARCHS:
        raise ValueError(
            f"GGUF general.architecture {arch!r} is not supported; supported: llama, qwen3moe"
        )
    heads, kv_heads = meta[f"{arch}.attention.head_count"], meta.get(f"{arch}.attention.head_count_kv")  # fmt: skip
    kv_heads = kv_heads or heads
    hidden = meta[f"{arch}.embedding_length"]
    names = {t.name: t for t in reader.tensors}
    experts = meta.get(f"{arch}.expert_count") or 0
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(names["token_embd.weight"].shape[1]),  # GGUF shapes are [in, out]
        "hidden_size": hidden,
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    moe_arch, model_type, expert_parts, block = _MOE_ARCHS[arch]
    if experts or arch != "llama":
        config |= {
            "architectures": [moe_arch],
            "model_type": model_type,
            "num_local_experts": experts,
            "num_experts_per_tok": meta[f"{arch}.expert_used_count"],
            "norm_topk_prob": True,  # llama.cpp's Mixtral and Qwen3-MoE renormalize the top k
        }
        if f"{arch}.expert_feed_forward_length" in meta:
            config["moe_intermediate_size"] = meta[f"{arch}.expert_feed_forward_length"]
    permute = arch == "llama"  # llama.cpp interleaves Llama's rotary halves, not Qwen's
    tensors = {}
    for t in reader.tensors:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        layer, _, part = t.name.removeprefix("blk.").partition(".")
        if part in _EXPERT_NAMES:  # one tensor per expert, as HF checkpoints hold them
            kind = expert_parts[_EXPERT_NAMES[part]]
            for e in range(w.shape[0]):
                tensors[f"model.layers.{layer}.{block}.experts.{e}.{kind}.weight"] = w[e].clone()
            continue
        if part == "ffn_gate_inp.weight":
            tensors[f"model.layers.{layer}.{block}.gate.weight"] = w
            continue
        name = _hf_name(t.name)
        if name is None:
            continue
        # llama.cpp interleaves the rotary halves of q and k; undo it for rotate-half RoPE.
        if permute and name.endswith("q_proj.weight"):
            w = unpermute(w, heads)
        elif permute and name.endswith("k_proj.weight"):
            w = unpermute(w, kv_heads)
        tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(path, out)


def _save_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None  # e.g. rope_freqs: not used by the architectures we load


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
