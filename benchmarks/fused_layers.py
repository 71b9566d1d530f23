"""Steps of one engine three ways, alternating rounds in one process so drift on a shared
machine hits all alike: on the torch path (`torch`), with the fused layer kernels of
kernels/fused.cpp bound (`fused`), and with those plus the decode stack that runs a
decode-only step's layers in one C++ call (`stack`, model/decode_stack.py; int4 weights only).
Decode steps at each batch size (256 tokens of context each) and a prefill step of one
256-token prompt; the median ms per step of each and the speed-ups over torch.

    python benchmarks/fused_layers.py [--quantization gguf|none] [--batches 1,4,16,64]
        [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from quant_decode import finish_batch, start_batch  # beside this file

from tandem import LLM
from tandem.model import kernels
from tandem.model.layers import use_fused_kernels

MODES = ("torch", "fused", "stack")


def timed_rounds(llm: LLM, fn, rounds: int) -> dict[str, list[float]]:
    fused, model = kernels.fused(), llm.engine.runner.model
    stack = model.model.decode_stack
    times = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            use_fused_kernels(model, None if mode == "torch" else fused)
            model.model.decode_stack = stack if mode == "stack" else None
            times[mode].append(fn())
    use_fused_kernels(model, fused)
    model.model.decode_stack = stack
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(quantization=args.quantization, enable_prefix_caching=False)
    stack = llm.engine.runner.model.model.decode_stack is not None
    print(f"weights: {args.quantization}, activations: {llm.engine.runner.kv_cache.dtype}, "
          f"decode stack: {'yes' if stack else 'no (stack = fused)'}")  # fmt: skip
    print(f"{'step':>12} {'torch ms':>9} {'fused ms':>9} {'stack ms':>9} {'fused':>7} {'stack':>7}")  # fmt: skip

    def report(name, times):
        t, f, s = (statistics.median(times[k]) * 1e3 for k in MODES)
        print(f"{name:>12} {t:>9.2f} {f:>9.2f} {s:>9.2f} {t / f:>6.2f}x {t / s:>6.2f}x", flush=True)  # fmt: skip

    for n, running in enumerate(map(int, args.batches.split(","))):
        start_batch(llm, running, args.context, f"b{n}")

        def decode_steps():
            llm.engine.step()  # settle after the switch
            t = time.perf_counter()
            for _ in range(args.steps):
                llm.engine.step()
            return (time.perf_counter() - t) / args.steps

        report(f"decode x{running}", timed_rounds(llm, decode_steps, args.rounds))
        finish_batch(llm, running, f"b{n}")

    prefills = iter(range(10**6))

    def prefill_step():
        tag = f"p{next(prefills)}"
        t = time.perf_counter()
        start_batch(llm, 1, args.context, tag)  # one prompt: its prefill steps
        elapsed = time.perf_counter() - t
        finish_batch(llm, 1, tag)
        return elapsed

    report(f"prefill {args.context}", timed_rounds(llm, prefill_step, args.rounds))


if __name__ == "__main__":
    main()
