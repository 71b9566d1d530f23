"""One stream's time per output token against the memory roofline measured on this machine.

A decode step of one request reads every weight it multiplies once: the 4-bit projections'
packed bytes with their scales and zero points, and the output head (the default model's
tied Q8_0 head, two int4 terms, a fifth of the bytes). Nothing else that size moves: the
KV of one request at a few hundred tokens is a few MB. The roofline is those bytes over the
read bandwidth measured here (torch summing a 1 GiB tensor on all threads, best of 10), and
the figure is the measured TPOT against it: how close a step runs to what memory allows.

    python benchmarks/roofline.py [--input-len 256] [--output-len 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tandem import LLM, SamplingParams
from tandem.model.quant import QuantizedLinear


def read_bandwidth(gib: float = 1.0, repeats: int = 10) -> float:
    """Bytes per second torch reads a large float32 tensor at (a sum: reads only)."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def weight_bytes(llm: LLM) -> int:
    """Bytes a one-row decode step reads of the quantized layers (projections and head)."""
    total = 0
    for m in llm.engine.runner.model.modules():
        if isinstance(m, QuantizedLinear):
            for t in getattr(m, "terms", []):
                total += t.packed.numel() * t.packed.element_size()
                total += t.scales_zeros.numel() * t.scales_zeros.element_size()
            if hasattr(m, "q"):  # per-channel int8
                total += m.q.numel() + m.scale.numel() * m.scale.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory=0.5, max_model_len=2048, enable_prefix_caching=False)
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(args.input_len)]

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    tpot = min(
        (timed(args.output_len + 1) - timed(1)) / args.output_len for _ in range(args.repeats)
    )
    bandwidth = read_bandwidth()
    size = weight_bytes(llm)
    roof = size / bandwidth
    print(f"weights read a step: {size / 2**20:.1f} MiB ({llm.quantization})")
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    print(f"roofline TPOT {roof * 1e3:.2f} ms; measured TPOT {tpot * 1e3:.2f} ms "
          f"= {tpot / roof:.2f}x the roofline ({roof / tpot:.0%} of memory's rate)")  # fmt: skip


if __name__ == "__main__":
    main()
