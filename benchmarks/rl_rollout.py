"""A trainer pushing weights to a rollout engine, against a raw torch.distributed broadcast
of the same bytes, in one run on one host.

The trainer (this process) holds the model's weights in bf16 (the default model's: its
converted folder's tensors). First the raw baseline: a bare receiver process joins a gloo
group and takes --pushes broadcasts of every tensor (each push ends on a barrier: the bytes
have arrived). Then `tandem serve --enable-rl-endpoints` joins a group the same way
(/init_weights_update_group) and takes the same pushes as an RL loop sends them:
/pause_generation (in_place), /update_weights_from_distributed with one broadcast per tensor,
/continue_generation. Reported: the raw push time, tandem's push time (the update call's)
and pause time (pause to continue) at p50 and p99, and the bandwidth ratio (raw / tandem,
p50: 1.0 means the update costs nothing past the transfer). Then a level-2 sleep and wake-up:
the engine core's memory awake and asleep against its own before the model loaded (the
interpreter and its imports), and the wake-up time.

    python benchmarks/rl_rollout.py [--pushes 10] [--model PATH] [--serve-args "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_weights(model: str | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from tandem.model.loader import resolve_model

    folder = resolve_model(model)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            if not name.endswith("rotary_emb.inv_freq"):
                tensors[name] = t.to(torch.bfloat16).contiguous()
    return tensors


def receiver(port: int, manifest: str, pushes: int) -> None:
    """The raw baseline's other end: rank 1, every tensor of every push, nothing else."""
    specs = json.loads(Path(manifest).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1)
    buffers = [torch.empty(shape, dtype=torch.bfloat16) for _, shape in specs]
    for _ in range(pushes):
        for b in buffers:
            dist.broadcast(b, src=0)
        dist.barrier()
    dist.destroy_process_group()


def raw_pushes(tensors: dict, pushes: int) -> list[float]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([(n, list(t.shape)) for n, t in tensors.items()], f)
    cmd = [sys.executable, __file__, "--receive", str(port), f.name, str(pushes)]
    proc = subprocess.Popen(cmd)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    times = []
    for _ in range(pushes):
        t0 = time.perf_counter()
        for t in tensors.values():
            dist.broadcast(t, src=0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    proc.wait(60)
    os.unlink(f.name)
    return times


def in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    answer: dict = {}

    def send():
        r = httpx.post(url, json=body, timeout=600)
        answer.update(status=r.status_code, body=r.json())

    thread = threading.Thread(target=send)
    thread.start()
    return thread, answer


def tandem_pushes(url: str, tensors: dict, pushes: int) -> tuple[list[float], list[float]]:
    port = free_port()
    thread, init = in_background(
        f"{url}/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2},
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    thread.join()
    assert init["status"] == 200, init
    body = {"names": list(tensors), "dtypes": ["bfloat16"] * len(tensors),
            "shapes": [list(t.shape) for t in tensors.values()]}  # fmt: skip
    push_s, pause_s = [], []
    for i in range(pushes):
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=60)
        assert r.status_code == 200, r.text
        t1 = time.perf_counter()
        thread, update = in_background(
            f"{url}/update_weights_from_distributed", {**body, "weight_version": f"push-{i}"}
        )
        for t in tensors.values():
            dist.broadcast(t, src=0)
        thread.join()
        assert update["status"] == 200, update
        t2 = time.perf_counter()
        assert httpx.post(f"{url}/continue_generation", timeout=60).status_code == 200
        push_s.append(t2 - t1)
        pause_s.append(time.perf_counter() - t0)
    httpx.post(f"{url}/destroy_weights_update_group", timeout=60)
    dist.destroy_process_group()
    return push_s, pause_s


def sleep_and_wake(url: str) -> dict:
    """Level 2 and back: the engine core's memory awake, asleep, and the wake-up time."""
    r = httpx.post(f"{url}/sleep?level=2", timeout=600).json()
    t0 = time.perf_counter()
    httpx.post(f"{url}/wake_up", timeout=600).raise_for_status()
    return {"awake": r["rss_before"], "asleep": r["rss_after"], "start": r["rss_at_start"],
            "wake_s": time.perf_counter() - t0}  # fmt: skip


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: bundled)")
    ap.add_argument("--serve-args", default="--kv-cache-memory 0.2", help="for tandem serve")
    ap.add_argument("--receive", nargs=3, metavar=("PORT", "MANIFEST", "PUSHES"),
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args()
    if args.receive:
        receiver(int(args.receive[0]), args.receive[1], int(args.receive[2]))
        return
    from tandem.bench.servers import tandem_server

    tensors = load_weights(args.model)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    raw = raw_pushes(tensors, args.pushes)
    extra = ["--enable-rl-endpoints", *shlex.split(args.serve_args)]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        with tandem_server(free_port(), args.model, extra, log) as server:
            server.wait_ready(600)
            push, pause = tandem_pushes(server.base_url, tensors, args.pushes)
            mem = sleep_and_wake(server.base_url)
    mb = nbytes / 1e6
    print(f"{len(tensors)} tensors, {mb:.0f} MB in bf16, {args.pushes} pushes each, gloo on loopback")  # fmt: skip
    print(f"{'':24} {'p50 s':>8} {'p99 s':>8} {'MB/s p50':>9}")
    for name, xs in (("raw broadcast", raw), ("tandem update", push), ("tandem pause", pause)):
        print(f"{name:24} {p(xs, 0.5):8.3f} {p(xs, 0.99):8.3f} {mb / p(xs, 0.5):9.0f}")
    print(f"bandwidth ratio, tandem update / raw broadcast: {p(raw, 0.5) / p(push, 0.5):.2f}x "
          f"(p99/p50 of the pause: {p(pause, 0.99) / p(pause, 0.5):.2f})")  # fmt: skip
    base = mem["start"]
    above = (mem["asleep"] - base) / max(1, mem["awake"] - base)
    print(f"sleep level 2: engine core {mem['awake'] / 2**20:.0f} MiB awake, "
          f"{mem['asleep'] / 2**20:.0f} MiB asleep, {base / 2**20:.0f} MiB before its model "
          f"loaded (the interpreter and its imports): {above:.1%} of the awake memory above "
          f"that kept; wake-up {mem['wake_s']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
