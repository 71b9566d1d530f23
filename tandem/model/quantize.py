"""Swap a loaded model's projections and output head for quantized ones (quant.py): from its
own float weights (`int8`, `int4`, quantized at load) or, for a model converted from a GGUF
file, from that file's own blocks (`gguf`). A tied embedding then looks its rows up in the
quantized head, so the largest matrix is stored once, in 4 or 8 bits."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import zlib
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from tandem.model import kernels
from tandem.model.gguf_quant import BLOCK_BYTES, tensor_terms
from tandem.model.packed_linear import packing_available
from tandem.model.quant import (
    Int4Linear,
    Int4Term,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    int4_linear,
    int4_term,
    quantize_int4,
    quantize_int8,
    quantize_int8_groups,
)

log = logging.getLogger("tandem")

# fused projection -> the GGUF tensors of its shards, in order
GGUF_SHARDS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


def quantize_model(model, method: str, group: int, gguf_path: Path | None, shard=None) -> str:
    """Quantize in place; -> what the weights now are, for the engine's log and /v1/models.
    shard: the distributed.sharding.RankShard a split model's rank holds (a GGUF's blocks are
    read whole, then cut to it)."""
    if method == "none":
        return "none"
    described = _from_gguf(model, gguf_path, shard) if method == "gguf" else _from_float(model, method, group)  # fmt: skip
    _return_freed_memory()
    return described


def _return_freed_memory() -> None:
    """The float weights just dropped sit in glibc's heap (its mmap threshold grows past
    their size after the first frees); hand them back to the OS so resident memory shows
    the smaller model (measured on the default model: 670 -> 445 MB with a small KV pool)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _from_float(model, method: str, group: int) -> str:
    device = model.lm_head.weight.device

    def make(name: str, linear: nn.Linear):
        w, k = linear.weight.detach(), linear.in_features
        if method == "int8":
            return Int8Linear(k, linear.out_features, *quantize_int8(w), bias=linear.bias)
        if k % group:
            raise ValueError(
                f"quantization_group_size {group} does not divide the {k} input features of "
                f"{name}; use one that divides it"
            )
        term = int4_term(*(t.cpu() for t in quantize_int4(w, group)))
        return int4_linear(k, linear.out_features, [term], f"int4 (group {group})", linear.bias, device)  # fmt: skip

    for i, layer in enumerate(model.model.layers):
        for parent, attr in _projections(layer):
            setattr(parent, attr, make(f"layer {i} {attr}", getattr(parent, attr)))
    # The head in 8 bits with a scale per 32 columns (GGUF's Q8_0, as two int4 terms) either
    # way, as llama.cpp keeps a 4-bit model's output tensor in 6 or 8 bits: in 4 bits, or in
    # per-channel int8, it alone moved the default model's greedy output within a few tokens.
    lm = model.lm_head
    terms = [int4_term(*(t.cpu() for t in ts)) for ts in quantize_int8_groups(lm.weight.detach(), 32)]  # fmt: skip
    head = int4_linear(lm.in_features, lm.out_features, terms, "int8 (group 32)", lm.bias, device)
    tied = model.config.tie_word_embeddings
    _swap_head(model, head, head if tied else None)
    fmt = model.model.layers[0].self_attn.o_proj.fmt
    if model.moe_blocks():
        fmt += " (experts float)"
    return f"{fmt} projections, {head.fmt} output head{' and tied embedding' if tied else ''}"


def _from_gguf(model, path: Path | None, shard=None) -> str:
    if path is None:
        raise ValueError("quantization: gguf needs a .gguf model (it runs on the file's blocks)")
    device = model.lm_head.weight.device
    specs = _gguf_layers(model.config if shard is None else shard.cfg, path)
    specs = (specs if shard is None else shard.gguf_specs(specs)).items()
    built = {name: int4_linear(*spec, None, device) for name, spec in specs}
    formats: Counter = Counter()
    for i, layer in enumerate(model.model.layers):
        for parent, attr in _projections(layer):
            q = built.get(f"layers.{i}.{attr}")
            formats[q.fmt if q else "float"] += 1
            if q is not None:
                q.bias = getattr(parent, attr).bias  # Qwen2's q/k/v biases: from the float load
                setattr(parent, attr, q)
    head, embedding = built.get("lm_head"), built.get("embedding", built.get("lm_head"))
    _swap_head(model, head, embedding)
    kept = formats.pop("float", 0)
    if kept:
        log.info("%d projections are of GGUF types without an int4 kernel: kept in float", kept)
    layers = ", ".join(f"{n} {fmt}" for fmt, n in formats.most_common())
    return (
        f"GGUF blocks: projections {layers or 'none'}{f', {kept} float' if kept else ''}; "
        f"output head {head.fmt if head else 'float'}; "
        f"embedding {embedding.fmt if embedding else 'float'}"
    )


def _gguf_layers(cfg, path: Path) -> dict[str, tuple]:
    """Module name -> Int4Linear arguments for every layer the file's blocks can make,
    cached beside the GGUF's converted folder: reading a GGUF's metadata alone takes seconds
    (its vocabulary). The packed layout is tandem's own (quant.pack_cpu_q), the same on every
    CPU; "pack1" names it (a cache from before, in torch's layout of the CPU, is not read)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tandem.model.gguf import gguf_as_hf_folder

    # a subfolder: the float loader reads every *.safetensors at the top; named for the
    # block types read, so a tandem that reads more of them builds it anew
    types = zlib.crc32(" ".join(sorted(BLOCK_BYTES)).encode())
    cache = gguf_as_hf_folder(path) / "int4" / f"pack1-{types:08x}.safetensors"
    if not cache.exists():
        cache.parent.mkdir(exist_ok=True)
        specs = _read_gguf_layers(cfg, path)
        if not specs:  # no type with int4 terms (a float32 file): nothing to cache
            return {}
        tensors, meta = {}, {}
        for name, (k, n, terms, fmt) in specs.items():
            meta[name] = json.dumps([k, n, fmt, [t.group for t in terms]])
            for i, t in enumerate(terms):
                tensors[f"{name}.{i}.packed"], tensors[f"{name}.{i}.sz"] = t.packed, t.scales_zeros
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, cache)
    specs = {}
    with safe_open(str(cache), framework="pt") as f:
        for name, value in f.metadata().items():
            k, n, fmt, groups = json.loads(value)
            terms = [
                Int4Term(f.get_tensor(f"{name}.{i}.packed"), f.get_tensor(f"{name}.{i}.sz"), g)
                for i, g in enumerate(groups)
            ]
            specs[name] = (k, n, terms, fmt)
    return specs


def _read_gguf_layers(cfg, path: Path) -> dict[str, tuple]:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    # llama.cpp interleaves Llama's (and Mixtral's) rotary halves of q and k, not Qwen's
    llama = cfg.architecture in ("LlamaForCausalLM", "MixtralForCausalLM")
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if llama else {}
    wanted = {
        f"layers.{i}.{attr}": [(tensors[f"blk.{i}.{s}.weight"], heads.get(s)) for s in shards]
        for i in range(cfg.num_layers)
        for attr, shards in GGUF_SHARDS.items()
        if f"blk.{i}.{shards[0]}.weight" in tensors  # an MoE layer has no ffn_gate/up/down
    }
    embd = tensors["token_embd.weight"]
    wanted["lm_head"] = [(tensors.get("output.weight", embd), None)]  # none: tied
    if "output.weight" in tensors:
        wanted["embedding"] = [(embd, None)]
    specs = {}
    for name, shards in wanted.items():
        built = _fused(shards)
        if built is not None:
            specs[name] = built
    return specs


def _fused(shards: list) -> tuple | None:
    """Int4Linear arguments (in, out, terms, format) for GGUF tensors stacked by rows, or
    None if a shard's type has no int4 terms."""
    parts = [tensor_terms(t, heads) for t, heads in shards]
    if any(p is None for p in parts):
        return None
    width = max(len(p) for p in parts)
    for p in parts:  # Q4 shards beside Q8_0 ones: a second term of zeros
        while len(p) < width:
            q, scale, _ = p[0]
            p.append((torch.zeros_like(q), torch.zeros_like(scale), torch.zeros_like(scale)))
    terms = [int4_term(*(torch.cat(ts) for ts in zip(*(p[i] for p in parts)))) for i in range(width)]  # fmt: skip
    fmt = "+".join(dict.fromkeys(t.tensor_type.name for t, _ in shards))
    k, n = int(shards[0][0].shape[0]), sum(int(t.shape[1]) for t, _ in shards)
    return k, n, terms, fmt


def _projections(layer) -> list[tuple[nn.Module, str]]:
    """A layer's projections that quantize: an MoE layer's experts stay in float (their
    grouped matmul has no quantized form), its shared expert quantizes."""
    attn, mlp = layer.self_attn, layer.mlp
    mlp = getattr(mlp, "shared_expert", mlp)
    dense = [] if mlp is None else [(mlp, "gate_up_proj"), (mlp, "down_proj")]
    return [(attn, "qkv_proj"), (attn, "o_proj"), *dense]


def _swap_head(model, head, embedding) -> None:
    """Put the quantized head in place and, where given, a quantized embedding (the head
    itself when the checkpoint ties them); a float embedding otherwise stays as it is."""
    dtype = model.model.embed_tokens.weight.dtype
    if head is not None:
        model.lm_head = head
    if embedding is not None:
        model.model.embed_tokens = QuantizedEmbedding(embedding, dtype)


def keep_bf16_copies(model) -> int:
    """QuantizedLinear.keep_dense_copy on every quantized layer; -> how many."""
    if not packing_available(torch.bfloat16, torch.device("cpu")):
        raise ValueError(
            "bf16_weight_copy needs a CPU that computes bf16 natively (AVX512-BF16 or AMX): "
            "emulated, the copy is slower than the quantized kernels"
        )
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.keep_dense_copy()
    _return_freed_memory()
    return len(layers)


def resolve_activation_quantization(name: str, method: str, device: torch.device) -> str:
    """auto -> int8 where int4_gemm's int8 path runs (int4 weights, a CPU with AVX512-VNNI on
    the dot path; real text's perplexity within 0.2% of the float path there, mean KL
    divergence 0.0035: benchmarks/activation_quality.py), else none; none and int8 as asked
    (int8 refused where it cannot run: check_activation_quantization)."""
    if name != "auto":
        check_activation_quantization(name, method, device)
        return name
    if method not in ("gguf", "int4") or device.type != "cpu":
        return "none"
    dequant = kernels.dequant()
    return "int8" if dequant is not None and dequant.int8_activations_here() else "none"


def check_activation_quantization(name: str, method: str, device: torch.device) -> None:
    """activation_quantization int8 runs in int4_gemm's dot path (AVX512-BF16 and VBMI, no
    AMX: there AMX's bf16 tiles are the faster path) where the CPU has AVX512-VNNI, on int4
    weights: refused elsewhere, before anything loads."""
    if name == "none":
        return
    if method not in ("gguf", "int4"):
        raise ValueError(
            f"activation_quantization {name}: needs int4 weights (a GGUF's Q4_0/Q4_1 blocks or "
            f"--quantization int4), not quantization {method}"
        )
    dequant = kernels.dequant() if device.type == "cpu" else None
    if dequant is None or not dequant.int8_activations_here():
        raise ValueError(
            f"activation_quantization {name} needs a CPU with AVX512-BF16, AVX512-VNNI and "
            "VBMI and without AMX, and the C++ kernels (this device: "
            f"{device.type}); use none"
        )


def use_int8_activations(model, required: bool = True) -> int:
    """Int4Linear.use_int8_activations on every int4 layer (GGUF's Q4_0/Q4_1/Q8_0, HF int4
    and its 8-bit head); -> how many take it (none: an error if `required`, as asked by
    name, not by auto)."""
    count = sum(m.use_int8_activations() for m in model.modules() if isinstance(m, Int4Linear))
    if not count and required:
        raise ValueError(
            "activation_quantization int8: no layer takes it (int4 terms, groups of a multiple "
            "of 32, no bf16 weight copy)"
        )
    return count


def use_rows_invariant(model) -> int:
    """QuantizedLinear.use_rows_invariant on every quantized layer (call after
    use_int8_activations: int8 activations keep their own invariant path); -> how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.use_rows_invariant()
    return len(layers)


def check_device(method: str, device: torch.device) -> None:
    """Quantized weights run on the CPU (torch's weight-only kernels and the C++ dense paths)
    or on CUDA (torch's int4 kernel, tinygemm, for few rows, and bf16 matmuls on weights
    dequantized by torch ops); refused elsewhere, before anything loads, rather than
    computed some other way."""
    if method != "none" and device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"quantization {method!r} runs on the CPU or CUDA, not {device.type}; "
            "use --quantization none (the float weights)"
        )
