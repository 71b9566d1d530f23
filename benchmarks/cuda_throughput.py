"""Offline throughput on a CUDA device: tandem's engine against HF transformers' generate()
on the same prompts, in one process, one after the other; and tandem on int4/int8 weights
quantized at load (torch's CUDA weight-only kernels).

No checkpoint can be downloaded where this runs, so the model is a Llama of a published
shape (Llama-3.2-1B by default) with seeded random weights: throughput does not depend on
the weights' values, and every run asks for exactly --output-len tokens (ignore_eos). Its
tokenizer is a word-level one of a few tokens (prompts are token ids; ids past it decode to
nothing). Each engine runs the whole workload once untimed first (CUDA picks and loads its
kernels for each new shape on first use), then the timed run; tandem's prints its mean
milliseconds a step by phase (on CUDA `sample` is where the step waits for the GPU).

    python benchmarks/cuda_throughput.py [--shape llama-3.2-1b] [--num-prompts 64]
        [--input-len 256] [--output-len 128] [--quantization none,int4,int8] [--json out.json]
    python benchmarks/cuda_throughput.py --layers [--shape llama-3.2-1b]

--layers: the shape's projections, every layer's own weights, by rows: bf16 F.linear against
the quantized layers' kernels (torch's int4 tinygemm, int8) and their dequantize-then-matmul
(`dense`): where the CUDA_KERNEL_MAX_ROWS of quant.py come from.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "tiny": dict(  # a dry run on any machine
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=1024, tie_word_embeddings=True,
    ),
}  # fmt: skip


def build_model(folder: Path, shape: str, device: str) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(61))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    config = LlamaConfig(
        **SHAPES[shape], bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def free_memory() -> None:
    """Give back what the engine just dropped before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_tandem(path: Path, prompts, output_len: int, quantization: str, args) -> dict:
    from tandem import LLM, SamplingParams

    llm = LLM(
        str(path), dtype="bfloat16", device=args.device, quantization=quantization,
        kv_cache_memory=args.kv_cache_gib, max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: CUDA's kernels for each shape
    outs, phases, core = [], {}, llm.engine
    step = core.step

    def timed_step():  # each phase's seconds summed (on CUDA the sample waits for the GPU)
        before = core.num_steps
        out = step()
        if core.num_steps > before:  # a step that ran the model (else its timings are stale)
            for phase, t in core.last_step_timings.items():
                phases[phase] = phases.get(phase, 0.0) + t
            phases["steps"] = phases.get("steps", 0) + 1
        return out

    core.step = timed_step
    seconds = timed(lambda: outs.extend(llm.generate(prompts, params, use_tqdm=False)))
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * output_len, tokens
    result = {"engine": f"tandem ({quantization})", "seconds": seconds, "tokens": tokens,
              "weights": llm.quantization,
              "first": outs[0].outputs[0].token_ids[:16],
              "ms_per_step": {k: round(v / phases["steps"] * 1e3, 2) for k, v in phases.items() if k != "steps"},
              "steps": phases["steps"]}  # fmt: skip
    llm = None
    free_memory()
    return result


def run_hf(path: Path, prompts, output_len: int, device: str) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    with torch.inference_mode():
        model.generate(ids, generation_config=gen)  # warm-up, as tandem's
        out = []
        seconds = timed(lambda: out.append(model.generate(ids, generation_config=gen)))
    tokens = (out[0].shape[1] - ids.shape[1]) * ids.shape[0]
    first = out[0][0, ids.shape[1] : ids.shape[1] + 16].tolist()
    model = out = None
    free_memory()
    return {"engine": "HF transformers generate()", "seconds": seconds, "tokens": tokens,
            "first": first}  # fmt: skip


def time_layers(shape: str, device: str, rows_list) -> None:
    from tandem.model.quant import Int8Linear, int4_linear, int4_term, quantize_int4, quantize_int8

    c = SHAPES[shape]
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * inter), (inter, h)]
    shapes = shapes * c["num_hidden_layers"]  # (in, out): qkv, o, gate_up, down
    torch.manual_seed(0)
    dev = torch.device(device)
    weights = [torch.randn(o, k, device=dev, dtype=torch.bfloat16) * 0.02 for k, o in shapes]
    int4 = [int4_linear(w.shape[1], w.shape[0], [int4_term(*(t.cpu() for t in quantize_int4(w, 32)))],
                        "int4", None, dev) for w in weights]  # fmt: skip
    int8 = [Int8Linear(w.shape[1], w.shape[0], *quantize_int8(w)) for w in weights]
    paths = {
        "bf16": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights],
        "int4 kernel": [m.kernel for m in int4],
        "int4 dense": [m.dense for m in int4],
        "int8 kernel": [m.kernel for m in int8],
        "int8 dense": [m.dense for m in int8],
    }
    if not int8[0].can_dense:  # a CPU without the C++ kernels
        del paths["int8 dense"], paths["int4 dense"]
    print(f"{shape}'s projections ({len(shapes)} matmuls), ms by rows, on {dev}")
    print("rows " + "".join(f"{p:>13s}" for p in paths))
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for k in {h, inter}}
        cells = []
        for fns in paths.values():

            def run(fns=fns, inputs=inputs):
                for (k, _), fn in zip(shapes, fns):
                    fn(inputs[k])

            cells.append(timed(run) and min(timed(run) for _ in range(3)) * 1e3)
        print(f"{rows:4d} " + "".join(f"{c:13.2f}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--quantization", default="none,int4,int8")
    ap.add_argument("--kv-cache-gib", type=float, default=16.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", action="store_true")
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,512,2048,8192")
    args = ap.parse_args()
    if args.layers:
        return time_layers(args.shape, args.device, [int(r) for r in args.rows.split(",")])
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args.shape, args.device)
        if not args.no_peer:
            results.append(run_hf(path, prompts, args.output_len, args.device))
        for q in args.quantization.split(","):
            try:
                results.append(run_tandem(path, prompts, args.output_len, q, args))
            except ValueError as e:  # a quantization this torch has no kernel for here
                print(f"tandem ({q}): refused: {e}")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\n{args.shape}, {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out, bf16, on {name}, torch {torch.__version__}")  # fmt: skip
    peer = results[0] if not args.no_peer else None
    for r in results:
        r["tok_per_s"] = r["tokens"] / r["seconds"]
        ratio = f"  {r['tok_per_s'] / (peer['tokens'] / peer['seconds']):.2f}x HF" if peer else ""
        print(f"  {r['engine']:32s} {r['seconds']:7.2f} s  {r['tok_per_s']:9.0f} output tok/s{ratio}")  # fmt: skip
        if "ms_per_step" in r:
            print(f"    {r['steps']} steps, ms a step: {r['ms_per_step']}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "device": name, "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
