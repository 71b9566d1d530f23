"""Attention over a paged KV cache on this machine: which formulation is fastest?

Times one layer of decode (single-token queries) and prefill (one long chunk) for the default
model's head shapes, several ways, and prints each relative to the torch path tandem uses for
the dtype (attention_fn). Decode also times the C++ kernel, which reads the paged cache in
place (tandem/model/kernels; TANDEM_NO_CPP_KERNELS=1 leaves it out), and bf16 prefill the
C++ prefill kernel (causal pairs only, from the paged cache; AVX512-BF16 CPUs), and prompts
with no cached context `causal_sdpa` (SDPA with is_causal on the step's own K and V).

    python benchmarks/attention_backends.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tandem.model import kernels
from tandem.model.attention import (
    _grouped_attention,
    attention_fn,
    causal_sdpa,
    grouped_attention,
    sdpa_attention,
)

H, KVH, D, BS, NBLOCKS = 9, 3, 64, 16, 4096
LAYERS = 30  # the default model's


def best_ms(fns, repeat=7, number=10):
    """Best of `repeat` runs, ms per call, for each fn; the runs interleave across fns so load
    from other processes on a shared machine falls on all of them alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(number):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / number)
    return {name: t * 1e3 for name, t in best.items()}


def cases(b, q, ctx, dtype):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(NBLOCKS, BS, KVH, D, generator=g).to(dtype)  # tandem's layout
    vc = torch.randn(NBLOCKS, BS, KVH, D, generator=g).to(dtype)
    nb = ctx // BS
    bt = torch.randint(1, NBLOCKS, (b, nb), generator=g)
    qt = torch.randn(b, q, H, D, generator=g).to(dtype)
    start = ctx - q
    mask = torch.arange(ctx)[None, None, :] <= (start + torch.arange(q))[None, :, None]
    mask = mask.expand(b, q, ctx)
    scale = D**-0.5

    def gather(cache):
        return cache.index_select(0, bt.view(-1)).view(b, ctx, KVH, D)

    def tandem():
        return grouped_attention(qt, gather(kc), gather(vc), mask, scale)

    def sdpa():
        k, v = gather(kc).transpose(1, 2), gather(vc).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qt.transpose(1, 2), k, v, attn_mask=mask[:, None], enable_gqa=True, scale=scale
        )
        return out.transpose(1, 2)

    def advanced_index_gather():
        k, v = kc[bt].view(b, ctx, KVH, D), vc[bt].view(b, ctx, KVH, D)
        return grouped_attention(qt, k, v, mask, scale)

    def all_rows_at_once():  # before QUERY_BLOCK
        return _grouped_attention(qt, gather(kc), gather(vc), mask, scale)

    fused = kernels.fused()
    fns = {
        "index_select + grouped matmul": tandem,
        "  the same, C++ softmax (kernels/fused.cpp)": lambda: grouped_attention(
            qt, gather(kc), gather(vc), mask, scale, softmax=fused.masked_softmax_
        ),
        "  the same, all query rows at once": all_rows_at_once,
        "index_select + sdpa enable_gqa": sdpa,
        "cache[block_tables] + grouped matmul": advanced_index_gather,
    }
    if fused is None or dtype != torch.bfloat16:  # the C++ softmax is for bf16 scores
        del fns["  the same, C++ softmax (kernels/fused.cpp)"]
    prefill = kernels.prefill_attention()
    if q > 1 and prefill is not None and dtype == torch.bfloat16:
        starts, ends = torch.full((b,), start), torch.full((b,), ctx)
        fns["C++ prefill kernel (no gather, causal pairs only)"] = lambda: prefill(
            qt, kc, vc, bt, starts, ends, scale
        )
    if q > 1 and start == 0:  # a fresh prompt: its keys are this step's own, no gather
        own_k, own_v = (gather(c).reshape(b * q, KVH, D) for c in (kc, vc))
        fns["sdpa is_causal on the step's own K/V (causal_sdpa)"] = lambda: causal_sdpa(
            qt.reshape(b * q, H, D), own_k, own_v, [q] * b, scale
        ).view(b, q, H, D)
    decode = kernels.paged_decode_attention()
    if q == 1 and decode is not None:
        lens = torch.full((b,), ctx)
        fns["C++ paged decode kernel (no gather)"] = lambda: decode(
            qt[:, 0], kc, vc, bt, lens, scale
        )[:, None]
        # As in a decode step: each layer's KV was last read a step ago, so it comes from
        # memory, not cache. LAYERS caches in turn, each holding just these rows' blocks.
        ids = torch.arange(b * nb).view(b, nb) + 1  # block 0 is the null block
        own = torch.cat([torch.zeros(1, dtype=torch.long), bt.view(-1)])
        cold = [(kc[own], vc[own])]  # the same keys as the rows above, so it is checked too
        cold += [
            tuple(torch.randn(b * nb + 1, BS, KVH, D, generator=g).to(dtype) for _ in "kv")
            for _ in range(LAYERS - 1)
        ]
        turn = iter(range(1 << 62))

        def decode_cold():
            k, v = cold[next(turn) % LAYERS]
            return decode(qt[:, 0], k, v, ids, lens, scale)[:, None]

        fns["  the same, each call a cold layer's cache"] = decode_cold
    ref = tandem().float()
    tolerance = 1e-2 if dtype == torch.float32 else 5e-2  # bf16: an ulp at 2-4 is 0.016
    for name, fn in fns.items():
        err = (fn().float() - ref).abs().max().item()
        assert err < tolerance, f"{name} disagrees by {err}"
    return fns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    torch_path = {
        grouped_attention: "index_select + grouped matmul",
        sdpa_attention: "index_select + sdpa enable_gqa",
    }[attention_fn(dtype, torch.device("cpu"))]
    print(f"{torch.get_num_threads()} threads; x: time / tandem's torch path ({torch_path})")
    for label, b, q, ctx in (
        ("decode", 32, 1, 256),
        ("decode", 64, 1, 512),
        ("prefill", 1, 512, 512),
        ("prefill", 1, 512, 1024),
        ("prefill", 1, 512, 2048),
        ("prefill", 8, 256, 256),
        ("prefill", 1, 2048, 2048),
    ):
        fns = cases(b, q, ctx, dtype)
        times = best_ms(fns)
        base = times[torch_path]
        print(f"{label} batch={b} query={q} context={ctx} ({args.dtype}), ms per layer:")
        for k, t in times.items():
            print(f"  {k:50s} {t:8.3f}  x{t / base:.2f}")


if __name__ == "__main__":
    main()
