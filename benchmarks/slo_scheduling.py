"""fcfs vs priority vs slo scheduling on one seeded multi-class workload, through the real
server, from light load to past saturation.

    python benchmarks/slo_scheduling.py [--num-prompts 200] [--seeds 0,1,2] [--cost-model cost.json]

30% interactive requests (short prompts; TTFT and TPOT targets) and 70% batch requests (long
prompts, loose targets), Poisson arrivals. First the saturation rate is measured (fcfs, all
requests at once); then every policy runs the same requests at each multiple of it, once per
seed (each seed draws other requests and arrival times). Prints per-class SLO attainment,
goodput and throughput per policy and rate, the mean over seeds and their range, and writes
slo-scheduling.json (every seed's figures) and slo-scheduling.png to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("fcfs", "priority", "slo")


def classes(args) -> tuple[list[dict], list[str]]:
    """The server's SLO classes file, and the bench's --class specs for the same classes."""
    served = [
        {"name": "interactive", "priority": 0, "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
         "on_overload": "shed"},
        {"name": "batch", "priority": 1, "ttft_ms": args.batch_ttft_ms, "tpot_ms": args.batch_tpot_ms,
         "on_overload": "demote"},
    ]  # fmt: skip
    bench = [
        f"name=interactive,share=0.3,input={args.interactive_input},output={args.output},"
        f"priority=0,ttft={args.ttft_ms},tpot={args.tpot_ms}",
        f"name=batch,share=0.7,input={args.batch_input},output={args.output},"
        f"priority=1,ttft={args.batch_ttft_ms},tpot={args.batch_tpot_ms}",
    ]
    return served, bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(url: str, args, specs: list[str], rates: str, name: str, seed: int) -> list[dict]:
    out = Path(args.result_dir)
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
           "--dataset-name", "multi-class", "--num-prompts", str(args.num_prompts),
           "--request-rate", rates, "--seed", str(seed), "--ignore-eos", "--send-slo-class",
           "--disable-tqdm", "--save-result", "--result-dir", str(out),
           "--result-filename", f"{name}.json"]  # fmt: skip
    for spec in specs:
        cmd += ["--class", spec]
    subprocess.run(cmd, check=False, cwd=ROOT, stdout=subprocess.DEVNULL)
    sweep = out / f"{name}-sweep.json"
    return (
        json.loads(sweep.read_text())["points"]
        if sweep.exists()
        else [json.loads((out / f"{name}.json").read_text())]
    )


def run_policy(policy: str, args, served, specs, rates: str, name: str, seeds) -> list[list]:
    """One server for the policy; the bench once per seed: [seed][rate] points."""
    from tandem.bench.servers import tandem_server

    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slo-classes.json").write_text(json.dumps(served))
    extra = ["--scheduling-policy", policy, "--slo-classes", str(out / "slo-classes.json"),
             "--disable-uvicorn-access-log", "--max-num-batched-tokens", str(args.max_tokens_step)]  # fmt: skip
    if args.cost_model:
        extra += ["--cost-model", args.cost_model]
    server = tandem_server(free_port(), args.model, extra, out / f"{name}.log")
    with server:
        server.wait_ready(600)
        return [bench(server.base_url, args, specs, rates, f"{name}-seed{s}", s) for s in seeds]


def summarize(point: dict) -> dict:
    att = point.get("slo_attainment", {})
    good = sum(att.get(c, {}).get("good", 0) for c in ("interactive", "batch"))
    inter = att.get("interactive", {})
    met = {f"interactive_{k}": n / inter["requests"] for k, n in inter.get("met", {}).items()}
    return {
        "rate": point["request_rate"],
        "interactive": inter.get("attainment", 0.0),
        **met,  # which of its targets the interactive class met, each on its own
        "batch": att.get("batch", {}).get("attainment", 0.0),
        "goodput": good / point["duration"],
        "throughput": point["output_throughput"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=200, help="requests per cell")
    ap.add_argument("--seeds", default="0,1,2", help="each draws other requests and arrivals")
    ap.add_argument("--multiples", default="0.5,1.0,1.5", help="of the saturation rate")
    ap.add_argument("--ttft-ms", type=float, default=1000)
    ap.add_argument("--tpot-ms", type=float, default=150)
    ap.add_argument("--batch-ttft-ms", type=float, default=30000)
    ap.add_argument("--batch-tpot-ms", type=float, default=1000)
    ap.add_argument("--interactive-input", default="32-96")
    ap.add_argument("--batch-input", default="384-768")
    ap.add_argument("--output", default="32-64")
    ap.add_argument("--max-tokens-step", type=int, default=512, help="--max-num-batched-tokens")
    ap.add_argument("--cost-model", default=None, help="from `tandem profile` (else online)")
    ap.add_argument("--result-dir", default="bench-results/slo")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--saturation", type=float, default=None,
                    help="req/s, from an earlier run (else measured first)")  # fmt: skip
    args = ap.parse_args()
    served, specs = classes(args)
    policies = args.policies.split(",")

    seeds = [int(x) for x in args.seeds.split(",")]
    saturation = args.saturation
    if saturation is None:
        sat = run_policy("fcfs", args, served, specs, "inf", "saturation", seeds[:1])[0][0]
        saturation = sat["completed"] / sat["duration"]
        print(f"saturation: {saturation:.3f} req/s (fcfs, {sat['completed']} requests at once)")
    multiples = [float(m) for m in args.multiples.split(",")]
    rates = ",".join(f"{m * saturation:.3f}" for m in multiples)
    per_seed = {  # policy -> seed -> rate -> summary
        p: [[summarize(pt) for pt in points] for points in run_policy(p, args, served, specs, rates, p, seeds)]
        for p in policies
    }  # fmt: skip
    results = {p: [spread([runs[i] for runs in per_seed[p]]) for i in range(len(multiples))]
               for p in policies}  # fmt: skip

    print(f"\n{len(seeds)} seeds x {args.num_prompts} requests a cell; mean (min-max over seeds)")
    for key, fmt in (("interactive", "{:.0%}"), ("batch", "{:.0%}"), ("goodput", "{:.3f}"),
                     ("throughput", "{:.1f}"), ("interactive_ttft", "{:.0%}"),
                     ("interactive_tpot", "{:.0%}")):  # fmt: skip
        print(f"{key}:")
        for i, m in enumerate(multiples):
            cells = []
            for p in policies:
                mean, lo, hi = (results[p][i][key][k] for k in ("mean", "min", "max"))
                cells.append(f"{p} {fmt.format(mean)} ({fmt.format(lo)}-{fmt.format(hi)})")
            print(f"  {m:>4.2f}x  " + "  ".join(f"{c:<30}" for c in cells))
    out = Path(args.result_dir)
    doc = {
        "saturation_rps": saturation,
        "multiples": multiples,
        "seeds": seeds,
        "results": results,
        "per_seed": per_seed,
        "args": vars(args),
    }
    (out / "slo-scheduling.json").write_text(json.dumps(doc, indent=2))
    plot(results, multiples, out / "slo-scheduling.png")
    print(f"\nsaved {out / 'slo-scheduling.json'} and {out / 'slo-scheduling.png'}")


def spread(points: list[dict]) -> dict:
    """Each figure's mean, min and max over seeds."""
    keys = {k for p in points for k in p}
    return {k: {"mean": statistics.fmean(p.get(k, 0.0) for p in points),
                "min": min(p.get(k, 0.0) for p in points),
                "max": max(p.get(k, 0.0) for p in points)} for k in sorted(keys)}  # fmt: skip


def plot(results: dict, multiples: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("interactive", "batch", "goodput"),
                              ("interactive SLO attainment", "batch SLO attainment", "goodput (req/s)")):  # fmt: skip
        for p in results:
            mean = [r[key]["mean"] for r in results[p]]
            line = ax.plot(multiples, mean, marker="o", label=p)[0]
            ax.fill_between(multiples, [r[key]["min"] for r in results[p]],
                            [r[key]["max"] for r in results[p]], color=line.get_color(), alpha=0.15)  # fmt: skip
        ax.set_title(title + " (band: seeds' range)")
        ax.set_xlabel("request rate (x saturation)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
