"""The default model's matmuls per decode step, three ways: torch's F.linear (MKL on x86
CPUs), oneDNN with prepacked weights (what tandem uses on the CPU in float32), and numpy
(OpenBLAS) as an outside reference. Prints ms per step and the ratio to F.linear.

    python benchmarks/linear_backends.py [--batches 1,16,32,64,256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

# (in, out) of one layer's fused projections, then the LM head: SmolLM2-135M
LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
HEAD = (576, 49152)
LAYERS = 30


def best_ms(fn, number=10, repeat=5):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t) / number)
    return min(times) * 1e3


def shape_ms(batch: int, i: int, o: int) -> dict[str, float]:
    x, w = torch.randn(batch, i), torch.randn(o, i)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    xn, wtn = x.numpy(), np.ascontiguousarray(w.t().numpy())
    n = 3 if o > 10000 else 10
    return {
        "F.linear": best_ms(lambda: torch.nn.functional.linear(x, w), n),
        "oneDNN packed": best_ms(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), n
        ),
        "numpy/OpenBLAS": best_ms(lambda: xn @ wtn, n),
    }


def step_ms(batch: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (i, o), times in [(s, LAYERS) for s in LAYER] + [(HEAD, 1)]:
        for k, v in shape_ms(batch, i, o).items():
            totals[k] = totals.get(k, 0.0) + times * v
    return totals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,32,64,256")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms of matmul per decode step"
    )
    for b in map(int, args.batches.split(",")):
        t = step_ms(b)
        base = t["F.linear"]
        row = "  ".join(f"{k} {v:7.1f} (x{base / v:.2f})" for k, v in t.items())
        print(f"batch {b:4d}: {row}")


if __name__ == "__main__":
    main()
