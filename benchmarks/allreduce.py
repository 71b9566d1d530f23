"""The tensor-parallel all-reduce: the shared-memory path against gloo's, on the same
tensors in one run. Two ranks (real processes, one thread each) sum a [rows, hidden] fp32
tensor `--iters` times each way; p50 and p90 per call, and the ratio of p50s.

    python benchmarks/allreduce.py [--rows 32] [--hidden 576,4096] [--iters 2000] [--json F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

from tandem.distributed.launch import free_port


def rank_main(rank: int, port: int, shapes, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    from tandem.distributed.groups import Ranks
    from tandem.distributed.layout import ParallelLayout

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, wait_for_workers=False)
    ranks = Ranks(ParallelLayout(tp=2), rank, store, 30.0, [0, 0], f"bench{port}")
    results = {}
    for rows, hidden in shapes:
        x = torch.randn(rows, hidden)
        for name in ("shm", "gloo"):
            if name == "gloo":
                ranks.shm, shm = None, ranks.shm
            times = []
            for i in range(iters + 100):
                y = x.clone()
                t = time.perf_counter()
                ranks.all_reduce(y)
                if i >= 100:  # warm-up
                    times.append(time.perf_counter() - t)
            if name == "gloo":
                ranks.shm = shm
            times.sort()
            results[f"{rows}x{hidden} {name}"] = (
                times[len(times) // 2],
                times[int(len(times) * 0.9)],
            )
    if rank == 0:
        out.put(results)
    ranks.close()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--hidden", default="576,4096")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shapes = [(args.rows, int(h)) for h in args.hidden.split(",")]
    ctx = mp.get_context("spawn")
    port, out = free_port("127.0.0.1"), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, shapes, args.iters, out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    results = out.get(timeout=600)
    for proc in procs:
        proc.join()
    report = {}
    print(f"{'tensor':>12} {'shm p50':>9} {'p90':>9} {'gloo p50':>9} {'p90':>9} {'gloo/shm':>9}")
    for rows, hidden in shapes:
        key = f"{rows}x{hidden}"
        (s50, s90), (g50, g90) = results[f"{key} shm"], results[f"{key} gloo"]
        report[key] = dict(shm_p50_us=s50 * 1e6, shm_p90_us=s90 * 1e6, gloo_p50_us=g50 * 1e6,
                           gloo_p90_us=g90 * 1e6, ratio=g50 / s50)  # fmt: skip
        print(f"{key:>12} {s50 * 1e6:8.1f}us {s90 * 1e6:8.1f}us {g50 * 1e6:8.1f}us {g90 * 1e6:8.1f}us {g50 / s50:8.1f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "allreduce", "rows": args.rows, "iters": args.iters, "results": report}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
