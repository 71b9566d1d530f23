"""The RL soak at full length: --calls random control calls (pause in every mode, resume,
weight updates between two checkpoints, prefix cache resets, sleep levels 1 and 2, wake)
against `tandem serve --enable-rl-endpoints` under --streams concurrent greedy requests
(tests/server/rl_soak.py does the calling and checking; the suite runs 80 calls of it).

Two seeded tiny Llama checkpoints (float32, so every request no update overlapped must equal
HF's greedy tokens for its version exactly). Prints each call's answers by status, the
requests' outcomes, and the failures: stale-KV hits, bad or late answers, hung requests, a
dead engine.

    python benchmarks/rl_soak.py [--calls 1000] [--streams 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from tandem.bench.servers import tandem_server
    from tests.conftest import build_checkpoint
    from tests.server.rl_soak import Soak

    with tempfile.TemporaryDirectory() as tmp:
        a = build_checkpoint(Path(tmp) / "a", "llama", seed=0)
        b = build_checkpoint(Path(tmp) / "b", "llama", seed=1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = ["--enable-rl-endpoints", "--dtype", "float32", "--kv-cache-memory", "0.02"]
        with tandem_server(port, str(a), extra, Path(tmp) / "serve.log") as server:
            server.wait_ready(300)
            t0 = time.monotonic()
            report = Soak(server.base_url, {"default": str(a), "b": str(b)}, args.seed).run(
                args.calls, args.streams
            )
            seconds = time.monotonic() - t0
    print(f"{args.calls} control calls under {args.streams} streams in {seconds:.0f} s")
    for (name, status), n in sorted(report.calls.items()):
        print(f"  {name:18} {status}: {n}")
    print("requests:", dict(report.requests))
    print(f"stale-KV hits {len(report.stale)}, bad calls {len(report.bad_calls)}, "
          f"hung requests {report.hung}, engine dead: {report.engine_dead}")  # fmt: skip
    for item in report.stale[:5] + report.bad_calls[:5]:
        print("  ", item)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
