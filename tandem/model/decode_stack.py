"""A decode-only step's whole layer stack in one C++ call (kernels/fused.cpp: DecodeStack).

At one running request, a decode step of the default model is ~120 int4 matmuls of 30 us
each and ~700 small calls whose Python cost (module calls, attribute lookups, argument
parsing) is a quarter of the step. GPU engines remove that cost by replaying a captured CUDA
graph; on the CPU the stack instead runs the layers' calls from C++, in the same order and
with the same kernels as model/llama.py, so its output equals the Python path's to the bit.

It runs only where it computes exactly what the Python layers would: every projection int4
(a GGUF's own blocks or --quantization int4), the fused kernels and the decode-attention
kernel bound (the KV cache in the compute dtype or 8-bit: the same KV write, quantizing as
kv_quant does, and the same kernel), and, per step, only single-token rows, no more than the
int4 kernel's row limit (or, where int4_gemm runs, its own: 240 on AMX), with no per-layer
hook (a prefill instance's KV sender). At 16 running requests on an AMX Xeon a decode step
of the default model takes ~4 ms less through it (18 vs 22 ms,
`python benchmarks/fused_layers.py`).
LoRA replaces the projections, so enabling it drops the stack (ModelRunner.enable_lora).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from tandem.model.attention import decode_only
from tandem.model.quant import Int4Linear


class DecodeStack:
    def __init__(self, stack, max_rows: int) -> None:
        self.stack = stack  # the C++ object, holding every layer's weights and caches
        self.max_rows = max_rows  # past this many rows the layers switch kernels

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """The final norm's output for embeddings x [B, hidden], or None: not a step the
        stack runs (the Python layers do)."""
        meta = decode_only()
        if meta is None or x.shape[0] > self.max_rows:
            return None
        g = meta.groups[0]
        return self.stack.forward(x, *rope, meta.slot_mapping, g.block_tables, g.context_lens)


def build_decode_stack(model: nn.Module, fused) -> DecodeStack | None:
    """The loaded model's layers as one DecodeStack, or None where one does not fit (see the
    module docstring)."""
    if fused is None or not hasattr(fused, "DecodeStack") or not model.plain_layers():
        return None
    inner = model.model
    layers = list(inner.layers)
    projections = [
        p
        for layer in layers
        for p in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )  # fmt: skip
    ]
    attns = [layer.self_attn.attn for layer in layers]
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if not layers or not all(
        type(p) is Int4Linear and len({t.group for t in p.terms}) == 1 for p in projections
    ):
        return None
    if not all(a.decode_kernel is not None and a.fused is not None for a in attns):
        return None
    if not all(n.fused is not None for n in [*norms, inner.norm]):
        return None
    attn, norm = attns[0], inner.norm
    stack = fused.DecodeStack(
        attn.num_heads, attn.num_kv_heads, attn.head_dim, norm.eps, attn.scale, norm.sum_lanes,
        norm.weight.detach(),
    )  # fmt: skip
    for layer, a in zip(layers, attns):
        sa, mlp = layer.self_attn, layer.mlp
        stack.add_layer(
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            *(_terms(p) for p in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)),
            a.k_cache, a.v_cache, a.k_scale, a.v_scale,
        )  # fmt: skip
    return DecodeStack(stack, min(_max_rows(p) for p in projections))


def _gemm(p: Int4Linear) -> bool:
    """Whether the layer's steps past its kernel's rows go through int4_gemm."""
    return p.can_dense and p.gemm_max_rows > 0


def _max_rows(p: Int4Linear) -> int:
    """Rows up to which the stack computes this projection as the layer would: past its
    kernel's rows, int4_gemm's; past those, the layer's slices, which the stack lacks."""
    if _gemm(p):
        return p.gemm_max_rows
    return p.kernel_max_rows if p.can_dense else sys.maxsize  # no dense path: the kernel


def _terms(p: Int4Linear):
    bias = None if p.bias is None else p.bias.detach()
    return (
        p.mm_packed,  # what torch's int4 matmul reads (the terms' own where int4_gemm runs)
        [t.scales_zeros for t in p.terms],
        p.terms[0].group,
        p.out_features,
        p.kernel_max_rows if _gemm(p) else sys.maxsize,  # past it: int4_gemm
        bias,
        p.int8_activations,
        p.invariant_gemm,
    )
