"""torch.compile of the decoder layers as an option, against tandem's eager layers with the
fused C++ ops (kernels/fused.cpp), on the same engine in one process, alternating rounds.

    python benchmarks/torch_compile.py [--rounds 3]

What it compiles: each LlamaDecoderLayer with `torch.compile(dynamic=True)` (inductor), the
paged attention left eager (`torch.compiler.disable`: its metadata and C++ kernels are not
traceable, and tracing into it recompiled on every batch shape), the layers' norms, RoPE,
SiLU*mul and linears given to inductor as plain torch ops. Two settings differ from serving:
the model is bf16 weights (`--quantization none`) and its linears are not prepacked for oneDNN
(inductor cannot lower a prepacked weight held as a module attribute): both sides run that
way, so the ratio is the compiler's against the fused ops. Each round runs prefill steps (8 x
256, 1 x 512 prompt tokens, one output token) and short generations (16 x 64 and 1 x 64
prompts, 33 tokens: mostly decode steps); the figures are medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import tandem.runner.model_runner as model_runner
    from tandem import LLM, SamplingParams
    from tandem.model import kernels
    from tandem.model.attention import PagedAttention
    from tandem.model.layers import use_fused_kernels

    model_runner.packing_available = lambda *a: False  # plain nn.Linear, which inductor lowers
    llm = LLM(quantization="none")
    model = llm.engine.runner.model
    model.model.decode_stack = None  # an int4-only path; this model has none anyway
    layers = model.model.layers
    eager = list(layers)
    fused = kernels.fused()
    PagedAttention.forward = torch.compiler.disable(PagedAttention.forward)
    torch.fx.experimental._config.use_duck_shape = False
    torch._dynamo.config.cache_size_limit = 64
    compiled = [torch.compile(layer, dynamic=True) for layer in eager]
    rng = random.Random(0)

    def use(compile_: bool) -> None:
        for i in range(len(layers)):
            layers[i] = compiled[i] if compile_ else eager[i]
        use_fused_kernels(model, None if compile_ else fused)  # inductor sees the plain ops
        for attn in model.attention_layers():  # eager both ways: the same KV write
            attn.fused = fused

    def run(b: int, n: int, out: int) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(n)] for _ in range(b)]
        params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == out for o in outs), "a request failed"
        return time.perf_counter() - t

    t = time.perf_counter()
    use(True)
    for b, n in ((8, 256), (1, 100), (2, 300), (16, 64)):
        run(b, n, 4)
    print(f"compiled and warmed up in {time.perf_counter() - t:.0f} s")
    print(f"{'work':<26} {'eager + fused ops':>18} {'torch.compile':>14} {'speed-up':>9}")
    for b, n, out in ((8, 256, 1), (1, 512, 1), (16, 64, 33), (1, 64, 33)):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for compile_ in (False, True):
                use(compile_)
                times[compile_].append(run(b, n, out))
        e, c = (statistics.median(times[k]) for k in (False, True))
        work = f"{b} x {n} prompt, {out} out"
        print(f"{work:<26} {e * 1e3:>15.0f} ms {c * 1e3:>11.0f} ms {e / c:>8.2f}x")


if __name__ == "__main__":
    main()
