"""KV transfer throughput on loopback TCP: tandem's connector (per-layer wire format, each
layer copied into a preallocated destination as it lands, as the decode engine's paged pool
would take it) against raw pyzmq sending the same bytes as the same multipart messages and
touching nothing, one run.

    python benchmarks/kv_transfer.py [--tokens 2048] [--repeats 5]

The KV is the default model's shape (SmolLM2-135M: 30 layers, 3 KV heads of 64) in bfloat16.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import zmq

from tandem.disagg.connector import KVReceiver, KVSender


def tandem_seconds(kv: torch.Tensor, cache: torch.Tensor) -> float:
    """Each layer lands in `cache` as it arrives, as the decode engine writes its pool."""
    receiver, sender = KVReceiver("tcp://127.0.0.1:0"), KVSender()

    def on_layer(rid, layer, start, k, v):
        cache[layer, 0].copy_(k)
        cache[layer, 1].copy_(v)

    start = time.perf_counter()
    t = threading.Thread(target=sender.send, args=(receiver.address, "r", 0, kv))
    t.start()
    while not receiver.poll(on_layer, 1000):
        pass
    elapsed = time.perf_counter() - start
    t.join()
    assert torch.equal(cache, kv)
    sender.close()
    receiver.close()
    return elapsed


def raw_seconds(kv: torch.Tensor) -> float:
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("tcp://127.0.0.1:0")
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    layers = [
        (kv[i, 0].view(torch.uint8).numpy(), kv[i, 1].view(torch.uint8).numpy())
        for i in range(kv.shape[0])
    ]

    def send():
        for k, v in layers:
            push.send_multipart([b"h", k, v], copy=False)

    start = time.perf_counter()
    t = threading.Thread(target=send)
    t.start()
    for _ in layers:
        pull.recv_multipart(copy=False)
    elapsed = time.perf_counter() - start
    t.join()
    push.close()
    pull.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    kv = torch.randn(30, 2, args.tokens, 3, 64).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    cache = torch.zeros_like(kv)  # a warm destination, as an engine's KV pool is
    ours = min(tandem_seconds(kv, cache) for _ in range(args.repeats))
    raw = min(raw_seconds(kv) for _ in range(args.repeats))
    print(f"KV of {args.tokens} tokens, {nbytes / 1e6:.1f} MB, best of {args.repeats}:")
    print(f"  tandem connector: {nbytes / ours / 1e9:.2f} GB/s ({ours * 1e3:.1f} ms)")
    print(f"  raw pyzmq:        {nbytes / raw / 1e9:.2f} GB/s ({raw * 1e3:.1f} ms)")
    print(f"  tandem / raw = {raw / ours:.0%} (target >= 80%)")


if __name__ == "__main__":
    main()
