"""What Python's cyclic garbage collector costs `tandem serve`, with and without the heap
built at startup frozen out of its reach (`tandem/engine/heap.py`: the API server, the
engine core and the router freeze theirs once started). The same seeded `tandem bench
serve` run against a real server, alternating the two settings, one run each per round:

    python benchmarks/gc_pauses.py [--rounds 2] [--num-prompts 200] [--request-rate 2]

Both servers' processes (API server and engine core) get a sitecustomize that logs every
full (generation 2) collection's pause; the "unfrozen" server's also makes gc.freeze a no-op,
which is the only difference. Prints per setting: full collections while the bench ran,
their total and longest pause, and the bench's p99 and longest inter-token latency and p99
TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from pd_disagg import free_port  # noqa: E402

SITECUSTOMIZE = """
import gc, os, time
if os.environ.get("GC_PAUSES_UNFROZEN"):
    gc.freeze = lambda: None
_log, _start = os.environ["GC_PAUSES_LOG"], [0.0]
def _observe(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    elif info["generation"] == 2:
        with open(_log, "a") as f:
            f.write(f"{os.getpid()} {time.time()} {time.perf_counter() - _start[0]}\\n")
gc.callbacks.append(_observe)
"""


def run(setting: str, args, seed: int, scratch: Path) -> dict:
    from tandem.bench.servers import tandem_server

    log = scratch / f"{setting}-{seed}.log"
    env = dict(os.environ, PYTHONPATH=f"{scratch}:{os.environ.get('PYTHONPATH', '')}",
               GC_PAUSES_LOG=str(log))  # fmt: skip
    if setting == "unfrozen":
        env["GC_PAUSES_UNFROZEN"] = "1"
    server = tandem_server(free_port(), None, ["--disable-uvicorn-access-log"],
                           scratch / f"{setting}-server.log")  # fmt: skip
    server.env = env
    server.start()
    try:
        server.wait_ready(600)
        began = time.time()
        cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url",
               server.base_url, "--ignore-eos", "--disable-tqdm", "--save-result",
               "--result-dir", str(scratch), "--result-filename", f"{setting}-{seed}.json",
               "--request-rate", str(args.request_rate), "--dataset-name", "random",
               "--num-prompts", str(args.num_prompts), "--random-input-len", "256",
               "--random-output-len", "64", "--random-range-ratio", "0.5",
               "--seed", str(seed), "--metric-percentiles", "99,100"]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        ended = time.time()
    finally:
        server.stop()
    result = json.loads((scratch / f"{setting}-{seed}.json").read_text())
    lines = log.read_text().split() if log.exists() else []
    pauses = [float(lines[i + 2]) for i in range(0, len(lines), 3)
              if began <= float(lines[i + 1]) <= ended]  # fmt: skip
    return {"full": len(pauses), "full_ms": 1e3 * sum(pauses),
            "longest_ms": 1e3 * max(pauses, default=0.0), "p99_itl_ms": result["p99_itl_ms"],
            "max_itl_ms": result["p100_itl_ms"], "p99_ttft_ms": result["p99_ttft_ms"],
            "throughput": result["output_throughput"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=float, default=2.0)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"unfrozen": [], "frozen": []}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        (scratch / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for r in range(args.rounds):
            for setting in results:  # same seed for both: the same requests
                out = run(setting, args, r, scratch)
                results[setting].append(out)
                print(f"round {r} {setting:>8}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()),
                      flush=True)  # fmt: skip
    print(f"\n{args.rounds} rounds of {args.num_prompts} requests at {args.request_rate} req/s "
          "(random 256 in / 64 out), `tandem serve` on the default model:")  # fmt: skip
    for setting, runs in results.items():
        print(f"{setting:>8}: {sum(o['full'] for o in runs)} full collections while serving, "
              f"{sum(o['full_ms'] for o in runs):.0f} ms paused in them (longest "
              f"{max(o['longest_ms'] for o in runs):.0f} ms); ITL p99 "
              + " / ".join(f"{o['p99_itl_ms']:.0f}" for o in runs) + " ms, longest "
              + " / ".join(f"{o['max_itl_ms']:.0f}" for o in runs) + " ms; TTFT p99 "
              + " / ".join(f"{o['p99_ttft_ms']:.0f}" for o in runs) + " ms")  # fmt: skip


if __name__ == "__main__":
    main()
