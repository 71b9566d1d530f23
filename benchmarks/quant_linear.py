"""The default model's matmuls per decode step (30 layers' projections, then the output
head), with each layer's own weights so they stream from memory as in a real step: bf16
F.linear, bf16 and float32 oneDNN on weights prepacked at load (tandem's float paths), and the quantized layers' two paths:
torch's int4 / int8 kernels and dequantize-then-bf16-matmul (`dense`: int4_gemm where the
CPU has AMX or AVX512-BF16; `int4 dense a8` its int8 activations, where it takes them: AVX512-VNNI
without AMX). Prints ms per step and each path's speed-up over bf16;
QuantizedLinear.KERNEL_MAX_ROWS is where the int4 kernel stops winning.

    python benchmarks/quant_linear.py [--batches 1,4,16,32,64,256] [--repeats 3]
    python benchmarks/quant_linear.py --head [--batches 1,2,4,8,12,16,32]

--head: the default model's own output head on its GGUF blocks (Q8_0, two int4 terms), the
int4 kernel against dense by rows: where Int4Linear.TWO_TERM_KERNEL_MAX_ROWS comes from (and
dense with int8 activations, where int4_gemm takes them).
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.model import kernels
from tandem.model.quant import Int4Linear, Int8Linear, int4_term, quantize_int4, quantize_int8

LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
HEAD = (576, 49152)
LAYERS = 30


def build():
    torch.manual_seed(0)
    shapes = LAYER * LAYERS + [HEAD]
    weights = [torch.randn(o, i) * 0.02 for i, o in shapes]
    return {
        "bf16": [w.bfloat16() for w in weights],
        "bf16 oneDNN": [
            torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in weights
        ],
        "fp32 oneDNN": [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights],
        "int4": [
            Int4Linear(w.shape[1], w.shape[0], [int4_term(*quantize_int4(w, 32))], "int4")
            for w in weights
        ],  # fmt: skip
        "int8": [Int8Linear(w.shape[1], w.shape[0], *quantize_int8(w)) for w in weights],
    }


def runners(layers):
    F = torch.nn.functional
    return {
        "bf16": lambda x, w: F.linear(x, w),
        "bf16 oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "fp32 oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(
            x.float(), w, None, "none", [], ""
        ),  # fmt: skip
        "int4 kernel": lambda x, m: m.kernel(x),
        "int4 dense": lambda x, m: m.dense(x),
        "int8 kernel": lambda x, m: m.kernel(x),
        "int8 dense": lambda x, m: m.dense(x),
        **({"int4 dense a8": _dense_int8_activations} if _int8_activations() else {}),
    }


def _int8_activations() -> bool:
    dequant = kernels.dequant()
    return dequant is not None and dequant.int8_activations_here()


def _dense_int8_activations(x, layer: Int4Linear):
    layer.int8_activations = True
    try:
        return layer.dense(x)
    finally:
        layer.int8_activations = False


def head(batches: list[int], repeats: int) -> None:
    from tandem import LLM

    layer = LLM(quantization="gguf").engine.runner.model.lm_head
    paths = {"kernel": layer.kernel, "dense": layer.dense}
    if _int8_activations():
        paths["dense a8"] = lambda x: _dense_int8_activations(x, layer)
    print(f"the default model's head: {layer}, {len(layer.terms)} terms; ms per call")
    print(f"{'rows':>5} " + " ".join(f"{n:>8}" for n in paths) + f" {'kernel/dense':>13}")
    for m in batches:
        x = torch.randn(m, layer.in_features, dtype=torch.bfloat16)
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(repeats):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn(x)
                best[name] = min(best[name], time.perf_counter() - t)
        cells = " ".join(f"{best[n] * 1e3:>8.2f}" for n in paths)
        print(f"{m:>5} {cells} {best['kernel'] / best['dense']:>12.2f}x", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head", action="store_true", help="the default model's Q8_0 head alone")
    args = ap.parse_args()
    if args.head:
        with torch.inference_mode():
            head([int(b) for b in (args.batches or "1,2,4,8,12,16,32").split(",")], max(5, args.repeats))  # fmt: skip
        return
    args.batches = args.batches or "1,4,16,32,64,256"
    layers = build()
    store = {"bf16": "bf16", "bf16 oneDNN": "bf16 oneDNN", "fp32 oneDNN": "fp32 oneDNN", "int4 kernel": "int4", "int4 dense": "int4", "int8 kernel": "int8", "int8 dense": "int8", "int4 dense a8": "int4"}  # fmt: skip
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per step (layers + head)"
    )
    names = list(runners(layers))
    print(f"{'rows':>5} " + " ".join(f"{n:>14}" for n in names))
    for m in map(int, args.batches.split(",")):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (576, 1536)}
        best = {n: float("inf") for n in names}
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all
            for n, fn in runners(layers).items():
                ws = layers[store[n]]
                shapes = LAYER * LAYERS + [HEAD]
                t = time.perf_counter()
                for (i, _), w in zip(shapes, ws):
                    fn(xs[i], w)
                best[n] = min(best[n], time.perf_counter() - t)
        cells = [f"{best[n] * 1e3:8.1f} {best['bf16'] / best[n]:4.1f}x" for n in names]
        print(f"{m:>5} " + " ".join(f"{c:>14}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
