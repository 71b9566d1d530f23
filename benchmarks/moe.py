"""The fused MoE layer (tandem/model/moe.py) against HF transformers' on the same weights, in
one run: router + experts of one layer, at a decode-sized and a prefill-sized step. HF runs
its expert loop (experts_implementation "eager": one pass per expert hit, the reference the
parity tests hold us to) and its default (`grouped_mm`, when transformers picks it).
Prints ms per call (median of --iters) and the ratios; checks the outputs agree first.

    python benchmarks/moe.py [--shapes olmoe,qwen3] [--tokens 16,256] [--dtypes bfloat16,float32]
                             [--iters 20] [--json F]

With --ep: a small Qwen3-MoE-shaped model (SERVE) decoding 32 running requests in float32,
whole on one process against split over two: experts by columns (-tp 2) and spread whole
(-tp 2 --enable-expert-parallel); greedy outputs must be identical, decode tok/s and ratios
printed. --write-model DIR writes that model (for `tandem bench compare --peer vllm`).

    python benchmarks/moe.py --ep [--rounds 3] [--json F]
    python benchmarks/moe.py --write-model DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.model.packed_linear import packing_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the served comparison's and --ep's model: Qwen3-MoE's shape, small (57M parameters in its
# layers, 50M in its embedding and head: the bundled model's 49,152-token vocabulary)
SERVE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
             intermediate_size=1024)  # fmt: skip

# one layer of each: (transformers model type, config.json's numbers)
SHAPES = {
    "olmoe": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8)),  # OLMoE-1B-7B
    "qwen3": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),  # Qwen3-30B-A3B
    "mixtral-small": ("mixtral", dict(hidden_size=1024, intermediate_size=1792, num_local_experts=8, num_experts_per_tok=2)),  # Mixtral 8x2 at 1/4 width
    "serve": ("qwen3_moe", dict(hidden_size=512, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4)),  # SERVE's layers
}  # fmt: skip


def layers(shape: str, dtype: torch.dtype, impl: str):
    """(HF's sparse MoE block with experts_implementation `impl`, ours) on the same weights."""
    from transformers import AutoConfig

    from tandem.core.model_config import ModelConfig
    from tandem.model.layers import SiluAndMul
    from tandem.model.moe import SparseMoE

    model_type, fields = SHAPES[shape]
    fields = dict(fields, num_hidden_layers=1, num_attention_heads=16, vocab_size=1000)
    hf_cfg = AutoConfig.for_model(model_type, **fields)
    arch = hf_cfg.architectures[0] if hf_cfg.architectures else None
    arch = arch or {"olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[model_type]  # fmt: skip
    hf_cfg._experts_implementation = impl
    module = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["x"])
    block_class = next(getattr(module, n) for n in dir(module) if n.endswith("SparseMoeBlock"))
    torch.manual_seed(0)
    hf = block_class(hf_cfg).to(dtype).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.02)
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": [arch]})
    ours = SparseMoE(cfg, SiluAndMul()).to(dtype)
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)
        ours.w2.copy_(hf.experts.down_proj)
    return hf, ours


def layer_rows(shape: str, dtype_name: str, tokens, iters: int) -> list[dict] | None:
    """One shape and dtype at each token count: HF eager, HF grouped_mm, ours (None: the
    outputs differ)."""
    dtype = getattr(torch, dtype_name)
    hf_eager, ours = layers(shape, dtype, "eager")
    hf_grouped, _ = layers(shape, dtype, "grouped_mm")
    hf_grouped.load_state_dict(hf_eager.state_dict())
    bind_fused(ours)
    if packing_available(dtype, torch.device("cpu")):
        ours.pack_experts()  # as the runner does (packed_linear.py)

    def hf_out(block, x):
        out = block(x)
        return out[0] if isinstance(out, tuple) else out

    rows = []
    for t in tokens:
        x = torch.randn(1, t, hf_eager.gate.weight.shape[1], dtype=dtype)
        with torch.no_grad():
            want, got = hf_out(hf_eager, x)[0].float(), ours(x[0]).float()
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        if err > (1e-5 if dtype == torch.float32 else 2e-2) * max(scale, 1e-6):
            print(f"{shape} {dtype_name} {t}: outputs differ by {err:.2e} (scale {scale:.2e})")
            return None
        eager = median_ms(lambda x: hf_out(hf_eager, x), x, iters)
        grouped = median_ms(lambda x: hf_out(hf_grouped, x), x, iters)
        fused = median_ms(lambda x: ours(x[0]), x, iters)
        rows.append(dict(shape=shape, dtype=dtype_name, tokens=t, hf_eager_ms=eager,
                         hf_grouped_mm_ms=grouped, tandem_ms=fused, vs_eager=eager / fused,
                         vs_grouped_mm=grouped / fused, max_abs_err=err))  # fmt: skip
        print(f"{shape:14} {dtype_name:9} {t:4} tokens: HF eager {eager:8.2f} ms, HF "
              f"grouped_mm {grouped:8.2f} ms, tandem {fused:8.2f} ms: "
              f"{eager / fused:5.2f}x eager, {grouped / fused:5.2f}x grouped_mm")  # fmt: skip
    return rows


def bind_fused(module) -> None:
    from tandem.model import kernels
    from tandem.model.layers import use_fused_kernels

    fused = kernels.fused()
    if fused is not None:
        use_fused_kernels(module, fused)


def median_ms(fn, x, iters: int) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def write_model(folder: Path) -> Path:
    """SERVE with random weights (seeded) and the bundled model's tokenizer (a real one: the
    random dataset's prompts keep their length through decode and encode)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tandem.model.gguf import gguf_as_hf_folder
    from tandem.model.loader import default_model_path

    tok = AutoTokenizer.from_pretrained(str(gguf_as_hf_folder(default_model_path())))
    tok.save_pretrained(str(folder))
    cfg = AutoConfig.for_model(
        "qwen3_moe", **SERVE, vocab_size=len(tok), max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, norm_topk_prob=True,
        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(folder))
    return folder


def decode_run(path: Path, rounds: int, **split) -> tuple[list[float], list[list[int]]]:
    """Decode tok/s of 32 running requests (128 tokens each), per round; the greedy tokens."""
    from tandem import LLM, SamplingParams

    prompts = [[100 + (i * 31 + j * 7) % 40000 for j in range(64)] for i in range(32)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    rates, tokens = [], []
    with LLM(str(path), dtype="float32", enable_prefix_caching=False, **split) as llm:
        llm.generate(prompts[:4], full, use_tqdm=False)  # warm-up
        for _ in range(rounds):
            t = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            outs = llm.generate(prompts, full, use_tqdm=False)
            rates.append(32 * 128 / (time.perf_counter() - t - prefill))
            tokens = [o.outputs[0].token_ids for o in outs]
    return rates, tokens


def expert_parallel(rounds: int, json_path: str | None) -> int:
    splits = {
        "whole": {},
        "tp2 (experts by columns)": dict(tensor_parallel_size=2),
        "tp2 --enable-expert-parallel": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "moe")
        rates, outputs = {name: [] for name in splits}, {}
        for _ in range(rounds):  # alternate, so drift on a shared machine hits all alike
            for name, split in splits.items():
                r, outputs[name] = decode_run(path, 1, **split)
                rates[name] += r
    same = {name: outputs[name] == outputs["whole"] for name in splits}
    base = statistics.median(rates["whole"])
    report = {}
    for name, r in rates.items():
        m = statistics.median(r)
        report[name] = dict(decode_tok_s=m, ratio=m / base, rounds=r, identical=same[name])
        print(f"{name:30} {m:8.1f} decode tok/s  {m / base:5.2f}x whole  greedy identical: {same[name]}")  # fmt: skip
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"bench": "moe_expert_parallel", "model": SERVE, "running": 32,
                       "dtype": "float32", "results": report}, f, indent=1)  # fmt: skip
    return 0 if all(same.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ep", action="store_true", help="expert parallel vs one process")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--write-model", default=None, metavar="DIR")
    p.add_argument("--shapes", default="olmoe,qwen3")
    p.add_argument("--tokens", default="16,256")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.write_model:
        print(write_model(Path(args.write_model)))
        return 0
    if args.ep:
        return expert_parallel(args.rounds, args.json)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")  # fmt: skip
    rows = []
    for shape in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            measured = layer_rows(shape, dtype_name, map(int, args.tokens.split(",")), args.iters)
            if measured is None:
                return 1
            rows += measured
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
